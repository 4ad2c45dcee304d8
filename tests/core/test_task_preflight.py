"""Issue 45 item 4: every probe of the plugin models' pre-flight is one line from ``loongforge check``, and ``train``
refuses with the same line before building anything (run through the fuzz harness: in-process, under its alarm,
``train`` stopped and counted as accepted if it gets past pre-flight). Also what makes them so: the generic checks
of ``task:`` numbers (:mod:`loongforge.config.numbers`, declared ranges) and ``model.freeze`` on a task model, which
``train`` now applies to the built module instead of ending in a ``TypeError``.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
from fuzz_harness import COMMANDS, Case, run
from fuzz_plugin_data import CODE_RAN, RunsCode
from loongforge.cli import main
from loongforge.config.numbers import check_finite
from loongforge.config.sections import Range
from loongforge.errors import ConfigError
from loongforge.models.task_freeze import freeze_task_model

pytestmark = pytest.mark.needs_plugins

ROOT = Path(__file__).resolve().parents[2]
WAN = str(ROOT / "configs" / "diffusion-moving-squares.yaml")
QWEN = str(ROOT / "configs" / "diffusion-squares-image.yaml")
POLICY = str(ROOT / "configs" / "embodied-tiny.yaml")

#: (recipe, overrides, text the one error line must hold). The issue's probes first, in its order.
PROBES = [
    (WAN, ["task.sample.steps=0"], "'task.sample.steps' must be an integer in [1, 1000], got 0"),
    (WAN, ["task.frames=3"], "videos of 3 x 12 x 12 (frames x height x width) do not divide into the model's 2x4x4"),
    (POLICY, ["task.action_horizon=0"], "'task.action_horizon' must be an integer >= 1, got 0"),
    (WAN, ["task.frames=0"], "'task.frames' must be an integer in [1, 128], got 0"),
    (WAN, ["task.side=-1"], "'task.side' must be an integer in [1, 256], got -1"),
    (WAN, ["task.ema.decay=1.5"], "'task.ema.decay' must be a finite number in [0, 1), got 1.5"),
    (WAN, ["model.freeze=['*']"], "model.freeze pattern '*' freezes every parameter: nothing would train"),
    (WAN, ["task.sample.guidance=.nan"], "'task.sample.guidance' must be a finite number >= 0, got nan"),
    (WAN, ["task.context_dropout=2.0"], "'task.context_dropout' must be a finite number in [0, 1], got 2.0"),
    (POLICY, ["task.eval.frames=-1"], "'task.eval.frames' must be an integer >= 0, got -1"),
    # the same rules, beyond the list
    (WAN, ["task.samples=8"], "task.samples: 8 training sample(s), fewer than training.micro_batch_size (16)"),
    (WAN, ["task.lora.targets=[bogus]"], "task.lora.targets: lora: unknown target 'bogus'"),
    (WAN, ["model.lora.rank=8"], "model.lora applies to megatron models; model 'wan-tiny' is trained by the task "
                                 "engine; set task.lora instead"),
    (WAN, ["model.overrides.in_channels=4"],
     "videos of 3 channels and no I2V condition; the model takes in_channels 4"),
    (QWEN, ["task.side=4"], "task.side: Geometry(frames=1, side=4, speed=2): the largest square cannot travel"),
    (QWEN, ["task.side=7"], "task.side 7 in"),
    (QWEN, ["task.sample.shift=0"], "'task.sample.shift' must be a finite number > 0, got 0.0"),
    (POLICY, ["task.cameras=[observation.images.wrist]"], "the flavor takes 1 of the synthetic set"),
    (POLICY, ["model.overrides.max_action_dim=1"], "actions have 2 dimensions, the flavor takes at most 1"),
    (POLICY, ["task.held_out_episodes=0", "evaluation.interval=5"], "task.held_out_episodes is 0, so no episode"),
]


@pytest.fixture(autouse=True)
def _environment(monkeypatch):
    monkeypatch.delenv("LOONGFORGE_DEVICE", raising=False)


@pytest.mark.parametrize(("recipe", "overrides", "message"), PROBES, ids=[" ".join(o) for _, o, _ in PROBES])
def test_each_probe_is_one_line_from_check_and_train_alike(recipe, overrides, message, tmp_path, capfd):
    case = Case("probe", (recipe, *overrides, f"run.output_dir={tmp_path / 'run'}"), tmp_path, (message,))
    checked, trained = (run(case, command, capfd) for command in COMMANDS)
    assert checked.problem() is None, checked.problem()
    assert trained.problem() is None and trained.error_line == checked.error_line, (trained.err, checked.err)


@pytest.mark.parametrize(("name", "content", "message"), [
    ("squares.pt", b"PK\x03\x04 cut", "cannot be read as training reads it (RuntimeError: PytorchStreamReader"),
    ("squares.pt", b"", "cannot be read as training reads it (EOFError: empty, or cut short)"),
    ("squares.pt", b"a caption\n", "cannot be read as training reads it (IndexError: pop from empty list)"),
    ("clips.jsonl", b'{"video": "notes.txt", "caption": "a square"}\n', "captioned videos are not training data"),
], ids=["truncated", "empty", "text", "jsonl"])
def test_diffusion_data_probes_are_one_line(name, content, message, tmp_path, capfd):
    """The issue's data probes: ``task.data`` at a truncated, empty or text ``.pt``, or a jsonl of non-videos."""
    data = tmp_path / name
    data.write_bytes(content)
    case = Case("data", (WAN, f"task.data={data}", f"run.output_dir={tmp_path / 'run'}"), tmp_path,
                (f"task.data {data}: {message}",))
    checked, trained = (run(case, command, capfd) for command in COMMANDS)
    assert checked.problem() is None and trained.problem() is None, (checked.err, trained.err)
    assert checked.error_line == trained.error_line


def test_a_pickle_that_would_run_code_is_refused_without_running_it(tmp_path, capfd):
    data = tmp_path / "squares.pt"
    data.write_bytes(pickle.dumps({"video": RunsCode(tmp_path / CODE_RAN)}))
    case = Case("pickle", (WAN, f"task.data={data}"), tmp_path, ("nothing in it was unpickled or run",))
    for command in COMMANDS:
        assert run(case, command, capfd).problem() is None
    assert not (tmp_path / CODE_RAN).exists()


# -- the generic checks ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Inner:
    span: tuple[float, float] = (0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class _Options:
    scale: float = 1.0
    inner: _Inner = dataclasses.field(default_factory=_Inner)


def test_every_float_of_a_task_section_must_be_finite():
    check_finite(_Options(), "run.yaml", "task")
    with pytest.raises(ConfigError, match=r"^run.yaml: 'task.inner.span' must be a finite number, got inf$"):
        check_finite(_Options(inner=_Inner((0.0, float("inf")))), "run.yaml", "task")
    with pytest.raises(ConfigError, match="'task.scale' must be a finite number, got nan"):
        check_finite(_Options(scale=float("nan")), "run.yaml", "task")


def test_range_bounds_read_as_written():
    assert Range(0, 2**31, high_open=True).describe(True) == "an integer in [0, 2147483648)"
    assert Range(0, low_open=True).describe(False) == "a finite number > 0"
    assert Range(0.5, 2.5).describe(False) == "a finite number in [0.5, 2.5]"


# -- model.freeze on a task model --------------------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))


def test_freeze_task_model_freezes_what_matches():
    model = _model()
    freeze_task_model(model, ["0.*"], "run.yaml")
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True]


@pytest.mark.parametrize(("patterns", "message"), [
    (["2.*"], r"^run.yaml: model.freeze pattern '2.\*' matches no parameter of the model \(its names look like "
              r"0.weight, 1.bias\)$"),
    (["0.*", "1.*"], r"freezes every parameter of the model: nothing would train"),
])
def test_freeze_task_model_refuses_in_one_line(patterns, message):
    with pytest.raises(ConfigError, match=message):
        freeze_task_model(_model(), patterns, "run.yaml")


def test_train_freezes_a_task_models_parameters(tmp_path, capfd):
    """``model.freeze`` on a diffusion DiT trains the rest (it ended in ``TypeError: 'WanModel' object is not
    iterable``); a pattern no parameter has is one line once the model is built, before any step."""
    common = [WAN, "training.steps=1", "task.samples=16", "task.sample.videos=0", "logging.progress=false"]
    assert main(["train", *common, "model.freeze=[blocks.0.*]", "checkpoint.save_at_end=true",
                 f"run.output_dir={tmp_path / 'a'}"]) == 0
    out, err = capfd.readouterr()
    assert "trainable parameters:" in out and "Traceback" not in err
    _init_is_held_to_the_model(tmp_path / "a" / "checkpoints" / "step-0000001", tmp_path, capfd)
    assert main(["train", *common, "model.freeze=[block.*]", f"run.output_dir={tmp_path / 'b'}"]) == 2
    out, err = capfd.readouterr()
    assert err.splitlines() == ["error: command line (model.freeze=[block.*]): model.freeze pattern 'block.*' "
                                "matches no parameter of the model (its names look like patch_embed.proj.weight, "
                                "head.proj.bias)"]
    assert not list((tmp_path / "b").rglob("step-*")) and "trainable parameters:" not in out


@pytest.mark.parametrize(("flag", "message"), [
    (["--guidance", "nan"], "--guidance must be a finite number >= 0, got nan"),
    (["--steps", "0"], "--steps must be an integer in [1, 1000], got 0"),
])
def test_sample_holds_its_flags_to_the_task_sample_ranges(flag, message, tmp_path, capsys):
    """``loongforge sample`` refuses what ``task.sample`` may not hold, before it opens the checkpoint."""
    assert main(["sample", str(tmp_path / "none"), "--prompt", "a red square", *flag]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {message}"]


def _init_is_held_to_the_model(checkpoint: Path, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """``task.init``: a task checkpoint of this model passes ``check``; of another width, or a directory whose files
    are not safetensors (Qwen-Image's loader ended in a SafetensorError traceback after the build), is one line from
    ``check`` and ``train`` alike, read from headers before anything is built."""
    assert main(["check", WAN, f"task.init={checkpoint}"]) == 0
    damaged = tmp_path / "released"
    damaged.mkdir()
    (damaged / "diffusion_pytorch_model.safetensors").write_bytes(b"garbage")
    for recipe, overrides, message in [
        (WAN, [f"task.init={checkpoint}", "model.overrides.ffn_dim=256"],
         "'blocks.0.ffn.fc1.weight' has shape [512, 128]; the model's is [256, 128]"),
        (QWEN, [f"task.init={damaged}"], "diffusion_pytorch_model.safetensors: not a readable safetensors file"),
    ]:
        case = Case("init", (recipe, *overrides, f"run.output_dir={tmp_path / 'b'}"), tmp_path, (message,))
        checked, trained = (run(case, command, capfd) for command in COMMANDS)
        assert checked.problem() is None and trained.problem() is None, (checked.err, trained.err)
        assert checked.error_line == trained.error_line


def test_the_batch_is_held_for_every_data_parallel_rank(capsys):
    """20 samples fill a step of one rank's 16, not of two ranks' (the engine draws 16 per data-parallel rank)."""
    assert main(["check", WAN, "task.samples=20"]) == 0
    assert main(["check", WAN, "task.samples=20", "--nproc", "2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: command line (task.samples=20): task.samples: 20 training sample(s), fewer than "
        "training.micro_batch_size (16) x 2 data-parallel ranks: no step could fill its batch"]
