"""The benchmark tool: measurement loop, report, and ``loongforge fp8-measure`` end to end in CPU emulation (its
progress per measured point included); on a machine without a GPU, ``--device cuda`` is one line."""

from __future__ import annotations

import json

import pytest
import torch
from loongforge.cli import main as cli_main
from loongforge_cuda.fp8 import blockwise as bw
from loongforge_cuda.fp8.measure import format_report, measure
from loongforge_cuda.fp8.policy import derive_policy, fp8_threshold, load_policy
from loongforge_cuda.fp8.runners import EmulatedLinearTimer, emulated_fp8_linear


class CostModelTimer:
    """A deterministic timer: BF16 costs the work, FP8 half the work plus a fixed quantisation price."""

    emulated, device, recipe = False, "model", "blockwise"

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, bool]] = []

    def time_ms(self, in_features, out_features, tokens, *, fp8):
        self.calls.append((in_features, out_features, tokens, fp8))
        work = in_features * out_features * tokens / 1e9
        return work / 2 + 0.5 if fp8 else work


def test_measure_times_both_precisions_at_each_count_and_scales_expert_tokens():
    timer = CostModelTimer()
    shapes = {"mlp.linear_fc1": (1000, 1000, 1.0), "mlp.experts.linear_fc1": (1000, 1000, 0.25)}
    results = measure(shapes, [500, 1000, 2000], timer)
    # FP8 wins once work/2 > 0.5 ms, i.e. above 1000 rows of a 1000x1000 GEMM.
    assert fp8_threshold(results["mlp.linear_fc1"]) == 2000
    assert fp8_threshold(results["mlp.experts.linear_fc1"]) is None  # an expert sees a quarter: 500 rows
    assert (1000, 1000, 500, True) in timer.calls and (1000, 1000, 125, False) in timer.calls
    assert len(timer.calls) == 2 * 3 * 2
    policy = derive_policy(shapes, results, device=timer.device, recipe=timer.recipe, emulated=False)
    report = format_report(policy)
    assert "mlp.linear_fc1  [1000 -> 1000]  FP8 from 2000 tokens" in report
    assert "mlp.experts.linear_fc1  [1000 -> 1000]  always BF16" in report
    assert "     2000 tokens  bf16    2.0000 ms  fp8    1.5000 ms  speed-up  1.33x" in report


def test_emulated_fp8_linear_is_the_reference_gemm():
    x, w = EmulatedLinearTimer().operands(256, 32, 16)
    exact = x.float() @ w.float().T
    for recipe, pow2 in (("blockwise", False), ("blockwise", True), ("tensorwise", False)):
        out = emulated_fp8_linear(x, w, recipe, pow2=pow2)
        assert out.dtype == torch.bfloat16 and out.shape == (16, 32)
        assert bw.relative_error(out, exact) < 0.05
    blockwise = bw.blockwise_matmul(bw.quantize_activation_blockwise(x), bw.quantize_weight_blockwise(w))
    assert torch.equal(emulated_fp8_linear(x, w, "blockwise"), blockwise.bfloat16())


def main(argv):
    return cli_main(["fp8-measure", *argv])


@pytest.mark.needs_plugins  # `loongforge fp8-measure` is the installed cuda plugin's command
def test_command_is_registered_and_its_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["fp8-measure", "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: loongforge fp8-measure")
    assert all(option in shown for option in ("--model", "--shape", "--tokens", "--recipe", "--device", "--out"))


@pytest.mark.needs_plugins  # `loongforge fp8-measure` is the installed cuda plugin's command
def test_cli_in_emulation_writes_a_policy_marked_emulated(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "plain")
    monkeypatch.setattr("loongforge.progress.PLAIN_EVERY_S", 0.0)
    out = tmp_path / "policy.json"
    rc = main(["--shape", "mlp.linear_fc1=128,256", "--shape", "mlp.experts.linear_fc2=64,128,0.5",
               "--tokens", "16,32", "--device", "cpu", "--repeat", "1", "--out", str(out)])
    captured = capsys.readouterr()
    printed = captured.out
    assert rc == 0
    assert printed.startswith("EMULATION: no FP8 GPU in use")
    # two modules x two token counts, each point one line on stderr (stdout keeps the report alone)
    shown = [line.split(" (")[0] for line in captured.err.splitlines()]
    assert shown == [f"timing BF16 vs FP8: {n}/4 point" for n in (1, 2, 3, 4)]
    assert captured.err.splitlines()[-1].endswith("[mlp.experts.linear_fc2 at 32 tokens]")
    assert "device: cpu, recipe: blockwise, tokens: 16,32" in printed and f"policy written to {out}" in printed
    policy = load_policy(out)
    assert policy.emulated and policy.device == "cpu" and policy.recipe == "blockwise"
    assert policy.modules["mlp.experts.linear_fc2"].tokens_scale == 0.5
    for entry in policy.modules.values():
        assert sorted(entry.timings) == [16, 32]
        assert entry.fp8_from_tokens == fp8_threshold(entry.timings)
    assert json.loads(out.read_text())["version"] == 1


@pytest.mark.needs_plugins  # `loongforge fp8-measure` is the installed cuda plugin's command
def test_cli_model_shapes(tmp_path, capsys):
    out = tmp_path / "policy.json"
    assert main(["--model", "llama-debug", "--tokens", "8", "--device", "cpu", "--repeat", "1", "--out", str(out)]) == 0
    assert sorted(load_policy(out).modules) == ["mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj",
                                                "self_attention.linear_qkv"]


@pytest.mark.needs_plugins  # `loongforge fp8-measure` is the installed cuda plugin's command
def test_cli_errors_are_one_line(tmp_path, capsys):
    out = str(tmp_path / "p.json")
    assert main(["--shape", "a=1,2", "--device", "cpu", "--recipe", "mxfp8", "--out", out]) == 2
    assert "error: FP8 recipe 'mxfp8' cannot be emulated; emulated: blockwise, tensorwise" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["--shape", "a=1,2", "--device", "cuda", "--out", out]) == 2
        assert capsys.readouterr().err == "error: no CUDA device visible; run with --device cpu for the emulation\n"
    assert main(["--shape", "a=1,2", "--device", "cpu", "--tokens", "8,x", "--out", out]) == 2
    assert capsys.readouterr().err == ("error: --tokens: expected comma-separated positive token counts, "
                                       "got '8,x'\n")
    assert main(["--model", "no-such-model", "--device", "cpu", "--out", out]) == 2
    assert "Unknown model 'no-such-model' (--model)" in capsys.readouterr().err
    assert main(["--shape", "a=1", "--device", "cpu", "--out", out]) == 2
    assert "expected kind=in_features,out_features" in capsys.readouterr().err
