"""``benchmarks/gpu_smoke.py``: which cases a GPU gets, and its CPU dry run end to end (children, both runners,
the JSON it writes). The GPU figures themselves need a GPU; this keeps the script runnable until one is lent."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.needs_plugins]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_smoke.py"
ALL_TE = frozenset({"DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"})


@functools.cache
def _script():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_smoke"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _reasons(planned) -> dict[str, str | None]:
    return {case.name: reason for case, reason in planned}


def test_an_h200_with_te_runs_every_case_but_mxfp8():
    reasons = _reasons(_script().plan(te_classes=ALL_TE, capability=(9, 0)))
    assert reasons.pop("lf-te-fp8-mxfp8") == "needs compute capability 10.0+"
    assert set(reasons) == {"lf-local-bf16", "mcore-local-bf16", "lf-te-bf16", "mcore-te-bf16", "lf-te-fp8-delayed",
                            "lf-te-fp8-tensorwise", "lf-te-fp8-blockwise", "lf-te-bf16-compiled",
                            "lf-local-bf16-compiled", "lf-local-fp16"}
    assert set(reasons.values()) == {None}


def test_without_te_only_local_cases_run():
    reasons = _reasons(_script().plan(te_classes=frozenset(), capability=(9, 0)))
    runs = {name for name, reason in reasons.items() if reason is None}
    assert runs == {"lf-local-bf16", "mcore-local-bf16", "lf-local-bf16-compiled", "lf-local-fp16"}
    assert reasons["lf-te-fp8-delayed"] == "transformer-engine is not installed"
    # an older TE without the blockwise recipe class: that recipe is named as missing, the others run
    old_te = _reasons(_script().plan(te_classes=ALL_TE - {"Float8BlockScaling"}, capability=(9, 0)))
    assert old_te["lf-te-fp8-blockwise"] == "Transformer Engine lacks Float8BlockScaling"
    assert old_te["lf-te-fp8-tensorwise"] is None


@pytest.mark.slow
def test_dry_run_trains_both_sides_on_the_cpu_and_writes_the_json(tmp_path):
    out = tmp_path / "smoke.json"
    # a generous budget: on idle cores the run takes ~30 s, on shared CI cores many times that
    child = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--budget-s", "1200",
                            "--cases", "lf-local-bf16", "mcore-local-bf16", "lf-te-bf16"],
                           capture_output=True, text=True, timeout=1500)
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and report["device"] == "cpu" and report["peak_bf16_tflops"] is None
    assert report["shape"] == {"model": "llama-tiny", "seq_length": 64, "micro_batch_size": 2, "precision": "fp32"}
    rows = {row["case"]: row for row in report["cases"]}
    assert list(rows) == ["lf-local-bf16", "mcore-local-bf16", "lf-te-bf16"]
    assert rows["lf-te-bf16"]["status"] == "not run" and rows["lf-te-bf16"]["reason"] == "CPU dry run"
    module = _script()
    for name in ("lf-local-bf16", "mcore-local-bf16"):
        row = rows[name]
        assert row["status"] == "ok" and set(module.RESULT_KEYS) <= set(row)
        assert row["tokens_per_s"] == pytest.approx(64 * 2 / (row["step_ms"] / 1e3))
        assert row["tflops"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / 1e12)
        assert row["mfu"] is None  # no peak on a CPU
        # both sides train the same tiny Llama from random weights over a 384-id vocabulary: loss near ln(384)
        assert 4.0 < row["final_loss"] < 7.5
    assert rows["lf-local-bf16"]["flops_per_token"] == rows["mcore-local-bf16"]["flops_per_token"]
    assert set(report["ratios"]) == {"lf-local-bf16 / mcore-local-bf16"}
