"""``loongforge check`` runs every pre-flight check ``train`` runs: it accepts every shipped recipe and rejects each
broken config in one line naming the file and the key, exactly as ``train`` then does.

Everything runs in this process through ``loongforge.cli.main`` (what the console script calls), so stdout/stderr
are what a user sees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
from loongforge import hookimpl, load_config
from loongforge.cli import main
from loongforge.devices.base import MegatronSettings
from loongforge.devices.cpu import CPUBackend
from loongforge.optimizations import Optimization

# Every recipe and half the broken configs are the plugins' models or sections (task:, dp-balance, model parts).
pytestmark = pytest.mark.needs_plugins

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))
QUICKSTART = "configs/quickstart.yaml"
EMBODIED = "configs/embodied-tiny.yaml"
METAWORLD = "configs/embodied-metaworld-reach.yaml"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    """Recipes name repo-relative paths (``data/metaworld/...``); run from the repository root like a user."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("LOONGFORGE_DEVICE", raising=False)


def check(capsys, config: str, *overrides: str) -> tuple[int, list[str], list[str]]:
    code = main(["check", config, *overrides])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


#: Recipes that start from another recipe's checkpoint (their ``model.load``) -> that recipe.
STARTS_FROM = {"dpo-tiny.yaml": "sft-tiny.yaml", "grpo-tiny.yaml": "sft-tiny.yaml",
               "vlm-dpo-shapes.yaml": "vlm-shapes.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_checks_ok(recipe, capsys, tmp_path):
    # The Meta-World recipes train on a LeRobot dataset their collect command writes (see each recipe's header); check
    # reports it missing (test_a_missing_data_directory_is_one_line), opens it, and accepts the recipe once it is one.
    overrides = []
    if "data/metaworld/" in recipe.read_text():
        from loongforge_embodied.data.synthetic import write_synthetic_dataset

        root, _ = write_synthetic_dataset(tmp_path / "dataset", version="v3.0")
        overrides = [f"task.data={root}", "task.held_out_episodes=1", "training.micro_batch_size=8"]  # 27 frames
    if recipe.name in STARTS_FROM:  # starts from another recipe's checkpoint (see its header): one step of it
        from loongforge.train.run import run_training

        run_training(load_config(f"configs/{STARTS_FROM[recipe.name]}", [
            f"run.output_dir={tmp_path / 'start'}", "training.steps=1", "training.sample_tokens=0",
            "logging.progress=false", "logging.trackers=[]"]))
        overrides = [f"model.load={tmp_path / 'start' / 'checkpoints'}"]
        capsys.readouterr()  # the training's output is not check's
    code, out, err = check(capsys, f"configs/{recipe.name}", *overrides)
    assert code == 0, err
    assert out[-1] == f"configs/{recipe.name}: OK"
    assert out[0] == "device: cpu (from loongforge-core)"
    assert any(line.startswith("model: ") for line in out)


def test_a_missing_data_directory_is_one_line(capsys):
    code, out, err = check(capsys, METAWORLD)
    assert code == 2 and out == []
    assert err == [f"error: {METAWORLD}: 'task.data' names data/metaworld/reach-v3-50, which does not exist"]


BROKEN = [
    # (config, overrides, what the one line must say)
    (QUICKSTART, ["parallel.tp=3", "--nproc", "3"], "tp=3 must divide the model's attention heads (4)"),
    (QUICKSTART, ["parallel.tp=3"], "tp*pp*cp*dp must equal the 1 processes started"),
    (QUICKSTART, ["model.overrides.num_layerz=2"], "unknown key 'model.overrides.num_layerz'"),
    (QUICKSTART, ["model.overrides.num_layers=two"], "'model.overrides.num_layers' must be an integer, got 'two'"),
    (QUICKSTART, ["scheduler.decay=cosin"], "'scheduler.decay' must be one of cosine, linear, constant, got 'cosin'; "
                                            "did you mean 'cosine'?"),
    (QUICKSTART, ["training.precision=fp16"], "training.precision / device_options: device 'cpu' cannot train in fp16"),
    (QUICKSTART, ["model.lora.base_dtype=fp8"], "model.lora.base_dtype must be bf16 (or null: the run's precision), "
                                               "got 'fp8'"),
    (QUICKSTART, ["model.load=hf:{tmp}/nonexistent"], "model.load: {tmp}/nonexistent/config.json: not found"),
    (QUICKSTART, ["data.paths=[{tmp}/missing.txt]"], "'data.paths[0]' names {tmp}/missing.txt, which does not exist"),
    (QUICKSTART, ["checkpoint.resume={tmp}/step-9"], "'checkpoint.resume' names {tmp}/step-9, which does not exist"),
    (QUICKSTART, ["device_options.bogus=1"], "device_options: device 'cpu' takes no megatron options; got bogus"),
    (QUICKSTART, ["optimizations.dp-balance.bogus=1"], "unknown key 'optimizations.dp-balance.bogus' (known keys here: "
                                                       "warmup_steps, cost, token_cap, length_key)"),
    (QUICKSTART, ["optimizations.dp-balance.warmup_steps=3"], "optimizations.dp-balance: warmup_steps must be an "
                                                              "integer >= 8"),
    (QUICKSTART, ["task.samples=3"], "unknown key 'task.samples' (model 'llama-tiny' takes no task: section)"),
    (QUICKSTART, ["logging.interval=0"], "logging.interval must be an integer >= 1"),
    (QUICKSTART, ["data.seq_length=100000"], "data.seq_length (100000) exceeds the model's max_position_embeddings"),
    (QUICKSTART, ["training.on_nonfinite=retry"],
     "'training.on_nonfinite' must be one of stop, skip_step, rewind, got 'retry'"),
    (QUICKSTART, ["optimizer.lr=.inf"], "optimizer.lr must be a finite number >= 0, got inf"),
    (QUICKSTART, ["optimizer.lr=-0.1"], "optimizer.lr must be a finite number >= 0, got -0.1"),
    (QUICKSTART, ["optimizer.min_lr=1e-2"], "optimizer.min_lr must be a finite number >= 0 and <= optimizer.lr "
                                            "(0.002), got 0.01"),
    (QUICKSTART, ["optimizer.weight_decay=-0.1"], "optimizer.weight_decay must be a finite number >= 0, got -0.1"),
    (QUICKSTART, ["optimizer.beta1=1"], "optimizer.beta1 must be in [0, 1), got 1"),
    (QUICKSTART, ["optimizer.beta2=-0.5"], "optimizer.beta2 must be in [0, 1), got -0.5"),
    (QUICKSTART, ["optimizer.eps=0"], "optimizer.eps must be a finite number > 0, got 0"),
    (QUICKSTART, ["optimizer.grad_clip=.nan"], "optimizer.grad_clip must be a finite number >= 0 (0 disables "
                                               "clipping), got nan"),
    (QUICKSTART, ["scheduler.warmup_steps=-1"], "scheduler.warmup_steps must be an integer >= 0, got -1"),
    (QUICKSTART, ["scheduler.decay_steps=0"], "scheduler.decay_steps must be an integer >= 1 (or unset: "
                                              "training.steps), got 0"),
    ("configs/diffusion-moving-squares.yaml", ["optimizer.lr=-1"], "optimizer.lr must be a finite number >= 0"),
    (EMBODIED, ["task.bogus=1"], "unknown key 'task.bogus' (known keys here: data, synthetic, held_out_episodes"),
    (EMBODIED, ["task.action_horizon=abc"], "'task.action_horizon' must be an integer, got 'abc'"),
    (EMBODIED, ["task.eval.frame=3"], "unknown key 'task.eval.frame' (known keys here: frames, steps, seed); did you "
                                      "mean 'frames'?"),
    (EMBODIED, ["task.normalization=zscore"], "task: normalization 'zscore' is unknown"),
    (EMBODIED, ["training.precision=fp16"], "training.precision 'fp16' is not supported for model 'pi05-tiny'"),
    (EMBODIED, ["parallel.tp=2"], "parallel.tp=2 with 'ddp': task models split weights over tensor-parallel ranks "
                                  "under parallel.strategy fsdp2 only"),
    ("configs/diffusion-moving-squares.yaml", ["task.flow_matching.sampling=gaussian"],
     "task.flow_matching: flow matching: sampling must be one of"),
    ("configs/diffusion-moving-squares.yaml", ["task.init={tmp}/weights"], "'task.init' names {tmp}/weights"),
    ("configs/diffusion-moving-squares.yaml", ["model.overrides.num_heads=four"],
     "'model.overrides.num_heads' must be an integer, got 'four'"),
    ("configs/vlm-shapes.yaml", ["model.overrides.vision_tokens_per_sample=many"],
     "'model.overrides.vision_tokens_per_sample' must be an integer, got 'many'"),
    ("configs/vlm-shapes.yaml", ["model.overrides.vision_tokens_per_samplez=8"],
     "unknown key 'model.overrides.vision_tokens_per_samplez'"),
    # plugin task options and data (issue 45 item 4): tests/core/test_task_preflight.py, through check and train
    # a batch no device holds (it would try to allocate terabytes), against the planner's lowest estimate
    (QUICKSTART, ["training.micro_batch_size=1000000000000"], "training.micro_batch_size=1000000000000 with "
                                                               "data.seq_length=256 needs at least"),
    (QUICKSTART, ["training.micro_batch_size=64", "parallel.planner.device_memory=64MiB"],
     "more than the device's 64 MiB"),
]


def test_overrides_are_checked_against_the_model_they_apply_to(capsys):
    """A composed model's overrides are fields of the composed model (not of what composes it)."""
    code, out, err = check(capsys, "configs/vlm-shapes.yaml", "model.overrides.vision_tokens_per_sample=16")
    assert code == 0 and out[-1] == "configs/vlm-shapes.yaml: OK", err


@pytest.mark.parametrize("config,overrides,message", BROKEN, ids=lambda v: v if isinstance(v, str) else None)
def test_broken_configs_are_one_line_naming_file_and_key(capsys, tmp_path, config, overrides, message):
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    code, out, err = check(capsys, config, *overrides)
    assert code == 2, out
    # where the mistake is: the override that set the key, the file and that override (a section check), or the
    # file (a check of the settings together); tests/core/test_cli_names.py pins which one for each kind of error
    origins = (f"{config}: ", f"command line ({overrides[0]}): ", f"{config} with command line ({overrides[0]}): ")
    assert len(err) == 1 and err[0].removeprefix("error: ").startswith(origins), err
    assert message.format(tmp=tmp_path) in err[0]
    assert not any(line.endswith(": OK") for line in out)


@pytest.mark.parametrize("overrides", [["training.precision=fp16"], ["model.overrides.num_layerz=2"],
                                       ["training.micro_batch_size=1000000000000"],
                                       ["scheduler.decay=cosin"], ["task.samples=3"], ["device_options.bogus=1"]])
def test_train_refuses_with_the_same_line_before_building_anything(capsys, tmp_path, overrides):
    overrides = [*overrides, f"run.output_dir={tmp_path}"]
    _, _, checked = check(capsys, QUICKSTART, *overrides)
    assert main(["train", QUICKSTART, *overrides]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == checked and len(checked) == 1
    assert not (tmp_path / "checkpoints").exists() and "model:" not in out  # nothing was built


def test_a_hugging_face_directory_must_describe_the_model(capsys, tmp_path):
    from loongforge.models.hf_config import hf_config_dict
    from loongforge.plugins import get_host

    llama = get_host().registry("model").load("llama-tiny")
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(llama, "fp32")))
    code, out, _ = check(capsys, QUICKSTART, f"model.load=hf:{tmp_path}")
    assert code == 0 and f"model.load: {tmp_path}" in out
    other = llama.with_overrides(num_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(other, "fp32")))
    code, _, err = check(capsys, QUICKSTART, f"model.load=hf:{tmp_path}")
    assert code == 2 and len(err) == 1
    assert f"model.load in {QUICKSTART}: {tmp_path}/config.json does not match model 'llama-tiny'" in err[0]
    assert "num_layers" in err[0]


def test_only_what_the_run_uses_is_printed(capsys):
    _, llm, _ = check(capsys, QUICKSTART)
    assert "dataset: shipped-corpus (from loongforge-core)" in llm and "tokenizer: byte (from loongforge-core)" in llm
    assert "parallel: tp=1 pp=1 cp=1 ep=1 dp=1 for 1 process(es), 1 micro-batch(es) per step" in llm
    _, policy, _ = check(capsys, EMBODIED)
    assert not any(line.startswith(("dataset:", "tokenizer:", "strategy: megatron", "precision:")) for line in policy)
    assert "parallel: ddp over 1 rank(s)" in policy
    _, vlm, _ = check(capsys, "configs/vlm-shapes.yaml")
    assert {"model.encoder: siglip-tiny", "model.projector: mlp", "model.foundation: qwen3-tiny"} <= set(vlm)
    _, layout, _ = check(capsys, QUICKSTART, "--nproc", "4", "parallel.tp=2")
    assert "parallel: tp=2 pp=1 cp=1 ep=1 dp=2 for 4 process(es), 1 micro-batch(es) per step" in layout


@dataclass(frozen=True)
class FakeOptions:
    overlap: bool = False
    recipe: Literal["fast", "exact"] = "exact"
    buckets: int = 1


class OptionsBackend(CPUBackend):
    """A CPU backend with device options: what ``megatron_settings`` receives is recorded."""

    name = "cpu-options"
    options_type = FakeOptions
    received: dict = {}

    def megatron_settings(self, precision: str = "fp32", **options):
        OptionsBackend.received = options
        return MegatronSettings(params_dtype=precision)


class OptionsDevicePlugin:
    @hookimpl
    def loongforge_register_devices(self, registry):
        registry.register("cpu-options", OptionsBackend)


@pytest.mark.parametrize("override,message", [
    ("device_options.overlap=maybe", "'device_options.overlap' must be true or false, got 'maybe'"),
    ("device_options.recipe=fsat", "'device_options.recipe' must be one of fast, exact, got 'fsat'; did you mean "
                                   "'fast'?"),
    ("device_options.bucket=2", "unknown key 'device_options.bucket' (known keys here: overlap, recipe, buckets); "
                                "did you mean 'buckets'?"),
])
def test_device_options_are_typed_by_the_backend(capsys, register_plugin, override, message):
    register_plugin(OptionsDevicePlugin(), "options-device")
    code, _, err = check(capsys, QUICKSTART, "device=cpu-options", override)
    assert code == 2 and err == [f"error: command line ({override}): {message}"]


def test_device_options_reach_the_backend_typed_and_only_as_given(capsys, register_plugin):
    register_plugin(OptionsDevicePlugin(), "options-device")
    code, _, err = check(capsys, QUICKSTART, "device=cpu-options", "device_options.buckets=4",
                         "device_options.recipe=fast")
    assert code == 0, err
    assert OptionsBackend.received == {"buckets": 4, "recipe": "fast"}


@dataclass(frozen=True)
class WarmupOptions:
    steps: int = 4
    mode: Literal["linear", "cosine"] = "linear"


class Warmup(Optimization):
    name = "warmup"
    options_type = WarmupOptions


class Untyped:
    """An optimization as plugins wrote them before the contract: a callable taking the raw mapping."""

    def __init__(self, options):
        self.options = options


class OptimizationPlugin:
    @hookimpl
    def loongforge_register_optimizations(self, registry):
        registry.register("warmup", Warmup)
        registry.register("untyped", Untyped)


@pytest.mark.parametrize("override,message", [
    ("optimizations.warmup.stpes=2", "unknown key 'optimizations.warmup.stpes' (known keys here: steps, mode); did "
                                     "you mean 'steps'?"),
    ("optimizations.warmup.mode=cosin", "'optimizations.warmup.mode' must be one of linear, cosine, got 'cosin'"),
    ("optimizations.untyped.x=1", "optimizations.untyped in configs/quickstart.yaml: optimization 'untyped' is "
                                  "registered as"),
])
def test_optimization_sections_are_typed_by_the_registered_class(capsys, register_plugin, override, message):
    register_plugin(OptimizationPlugin(), "optimizations")
    code, _, err = check(capsys, QUICKSTART, override)
    origin = QUICKSTART if override.startswith("optimizations.untyped") else f"command line ({override})"
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and origin in err[0] and message in err[0]


def test_an_enabled_optimization_reads_typed_options(register_plugin):
    register_plugin(OptimizationPlugin(), "optimizations")
    assert Warmup({"steps": 8}).options == WarmupOptions(steps=8)
    assert Warmup(None).options == WarmupOptions()


def test_a_misspelt_part_role_names_the_role_it_meant(capsys):
    # vlm-shapes sets parts without model.name: the one installed composition (loongforge-vlm's) checks the roles.
    code, out, err = check(capsys, "configs/vlm-shapes.yaml", "model.encodr=siglip-tiny")
    assert code == 2 and out == []
    assert err == ["error: configs/vlm-shapes.yaml: model.encodr: model 'vlm' has no part 'encodr'; its parts: "
                   "encoder, projector, foundation. Did you mean 'encoder'?"]
