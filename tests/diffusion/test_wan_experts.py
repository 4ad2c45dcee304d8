"""Wan 2.2 A14B's two experts for real (``wan-tiny-experts``: wan-tiny twice, split at sigma 0.875 like T2V-A14B).

- each training step runs and back-propagates through the expert that owns the noise levels it drew, and only that
  one: the other's gradients stay ``None``, so AdamW (with weight decay) leaves its weights bitwise alone;
- the draw of the expert follows the objective: the high expert trains as often as a one-model run visits its
  noise levels (checked against sampled levels, for a shifted uniform and a logit-normal objective);
- sampling switches at the boundary on the real modules (forward hooks record which expert saw which level), and a
  mixed batch is each sample through its own expert;
- ``task.init`` reads a released pipeline folder (diffusers' ``transformer``/``transformer_2`` built by diffusers,
  and the original ``high_noise_model``/``low_noise_model``) bitwise; ``loongforge check`` holds it to the model;
- a run with an EMA resumes bit-exactly (losses and each expert's average), ``convert mcore-to-hf`` writes both
  experts as diffusers folders that diffusers loads and that predict what ours do, and 2 DDP ranks equal 1 process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from loongforge import load_config
from loongforge.cli import main
from loongforge.errors import ConfigError
from loongforge.train.run import run_training
from loongforge.train.task_checkpoint import load_task_model
from loongforge_diffusion.flow_matching import FlowMatchingConfig, sample_sigmas
from loongforge_diffusion.sampling import sigma_schedule
from loongforge_diffusion.task import DiffusionTask
from loongforge_diffusion.wan.diffusers_adapter import from_diffusers
from loongforge_diffusion.wan.experts import choose_expert
from loongforge_diffusion.wan.original_adapter import to_original
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "diffusion-moving-squares.yaml"
BOUNDARY = 0.875
SMALL = ["model.name=wan-tiny-experts", "model.overrides={}", "logging.progress=false", "logging.tensorboard=false",
         "training.threads=1",
         "task.samples=64", "task.sample={videos: 0}", "training.micro_batch_size=4", "scheduler.warmup_steps=0",
         "task.flow_matching={shift: 3.0}"]
#: diffusers' WanTransformer3DModel arguments of wan-tiny-experts, written out here (not derived from our flavor).
DIFFUSERS_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=3,
                      out_channels=3, text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2, cross_attn_norm=True,
                      qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64)


def _config(out: Path, *overrides: str):
    return load_config(str(CONFIG), [f"run.output_dir={out}", *SMALL, *overrides])


def _perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return module


def _task(config):
    from loongforge.plugins import get_host

    return get_host().registry("model").load(config.model.name, where="test").make_task(config)


class Recorder:
    """The timesteps each expert's forward received, in call order (hooks on the real modules, removed on exit)."""

    def __init__(self, model) -> None:
        self.seen = {"high": [], "low": []}
        self.handles = [model.expert(name).register_forward_hook(
            lambda _module, args, _out, name=name: self.seen[name].append(args[1].detach().clone()))
            for name in self.seen]

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *_) -> None:
        for handle in self.handles:
            handle.remove()

    def levels(self, name: str) -> list[float]:
        return [float(t) / 1000 for batch in self.seen[name] for t in batch]


def test_each_step_trains_only_the_expert_owning_its_noise_levels(tmp_path):
    task = _task(_config(tmp_path / "run"))
    model = task.build_model()
    data = task.build_dataset()
    batch = {key: torch.stack([data[i][key] for i in range(4)]) for key in ("video", "context")}
    batch["index"] = torch.arange(4)
    trained = []
    for _ in range(12):
        model.zero_grad(set_to_none=True)
        with Recorder(model) as recorder:
            task.training_step(model, batch).backward()
        name, other = task.trained_expert, "low" if task.trained_expert == "high" else "high"
        trained.append(name)
        grads = [p.grad for p in model.expert(name).parameters()]
        assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
        assert all(p.grad is None for p in model.expert(other).parameters())
        assert recorder.seen[other] == [] and len(recorder.seen[name]) == 1
        levels = recorder.levels(name)
        assert all(s >= BOUNDARY for s in levels) if name == "high" else all(s < BOUNDARY for s in levels)
    assert set(trained) == {"high", "low"}, trained


@pytest.mark.parametrize("objective", [FlowMatchingConfig(shift=3.0),
                                       FlowMatchingConfig(sampling="logit-normal", logit_mean=1.0)])
def test_the_expert_is_drawn_as_often_as_one_model_visits_its_noise_levels(objective):
    steps = 4000
    high = sum(choose_expert(objective, BOUNDARY, seed=0, step=step)[0] == "high" for step in range(1, steps + 1))
    levels = sample_sigmas(40000, objective, torch.Generator().manual_seed(1))
    visited = float((levels >= BOUNDARY).double().mean())
    assert 0.1 < visited < 0.5  # the boundary is where the check has power
    assert abs(high / steps - visited) < 0.025, (high / steps, visited)
    name, restricted = choose_expert(objective, BOUNDARY, seed=0, step=1)
    assert restricted.sigma_range == pytest.approx((BOUNDARY, 1.0) if name == "high" else (0.0, BOUNDARY), abs=1e-7)


def test_no_level_drawn_for_the_low_expert_rounds_up_to_the_boundary():
    """Levels and timesteps are float32: the low expert's range must end below the boundary after rounding too."""
    objective = FlowMatchingConfig(shift=3.0)
    step = next(s for s in range(1, 100) if choose_expert(objective, BOUNDARY, seed=0, step=s)[0] == "low")
    top = choose_expert(objective, BOUNDARY, seed=0, step=step)[1].sigma_range[1]
    assert top < BOUNDARY and float(torch.tensor(top, dtype=torch.float32) * 1000) < BOUNDARY * 1000


def test_a_sigma_range_on_one_side_trains_that_expert_alone():
    one_side = FlowMatchingConfig(shift=3.0, sigma_range=(0.9, 1.0))
    assert {choose_expert(one_side, BOUNDARY, seed=0, step=s)[0] for s in range(1, 200)} == {"high"}


@pytest.fixture(scope="module")
def experts():
    task = _task(load_config(str(CONFIG), SMALL))
    torch.manual_seed(0)
    return _perturbed(task.build_model(), seed=3).eval()


@pytest.mark.parametrize("sampler", ["euler", "unipc"])
def test_sampling_switches_experts_at_the_boundary(experts, sampler):
    context = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    with Recorder(experts) as recorder:
        video = DiffusionTask().sample(experts, {"context": context}, 12, shape=(2, 3, 4, 16, 16), shift=3.0,
                                       sampler=sampler)
    assert torch.isfinite(video).all()
    high, low = recorder.levels("high"), recorder.levels("low")
    assert high and low and min(high) >= BOUNDARY and max(low) < BOUNDARY
    if sampler == "euler":  # exactly the schedule's levels, each through the expert that owns it
        schedule = sigma_schedule(12, 3.0)[:-1]
        assert sorted(set(high)) == pytest.approx(sorted(s for s in schedule if s >= BOUNDARY), abs=1e-6)
        assert sorted(set(low)) == pytest.approx(sorted(s for s in schedule if s < BOUNDARY), abs=1e-6)


def test_a_mixed_batch_is_each_sample_through_its_own_expert(experts):
    generator = torch.Generator().manual_seed(0)
    video, context = torch.randn(3, 3, 4, 8, 8, generator=generator), torch.randn(3, 5, 32, generator=generator)
    timestep = torch.tensor([950.0, 120.0, 875.0])
    with torch.no_grad():
        mixed = experts(video, timestep, context)
        alone = [experts.expert(name)(video[i:i + 1], timestep[i:i + 1], context[i:i + 1])
                 for i, name in enumerate(("high", "low", "high"))]
    assert (mixed - torch.cat(alone)).abs().max() < 1e-6
    assert (alone[0] - experts.low(video[:1], timestep[:1], context[:1])).abs().max() > 1e-3  # they differ


def _released_pipeline(root: Path, layout: str) -> dict[str, dict[str, torch.Tensor]]:
    """Two perturbed diffusers transformers saved as a released A14B folder; returns each expert in our names."""
    ours = {}
    for seed, (expert, folder) in enumerate((("high", "transformer"), ("low", "transformer_2"))):
        torch.manual_seed(seed)
        theirs = _perturbed(WanTransformer3DModel(**DIFFUSERS_TINY), seed=10 + seed)
        ours[expert] = from_diffusers(theirs.state_dict())
        if layout == "diffusers":
            theirs.save_pretrained(root / folder)
        else:
            directory = root / {"high": "high_noise_model", "low": "low_noise_model"}[expert]
            directory.mkdir(parents=True)
            save_file({k: v.contiguous() for k, v in to_original(ours[expert]).items()},
                      str(directory / "diffusion_pytorch_model.safetensors"))
            (directory / "config.json").write_text(json.dumps({"model_type": "t2v", "dim": 64, "num_heads": 4}))
    return ours


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_init_reads_both_experts_of_a_released_pipeline_bitwise(tmp_path, capsys, layout):
    expected = _released_pipeline(tmp_path / "pipe", layout)
    config = _config(tmp_path / "run", f"task.init={tmp_path / 'pipe'}")
    model = _task(config).build_model()
    for expert, tensors in expected.items():
        state = model.expert(expert).state_dict()
        assert sorted(state) == sorted(tensors)
        assert all(torch.equal(state[name], tensors[name]) for name in tensors)
    assert main(["check", str(CONFIG), *SMALL, f"task.init={tmp_path / 'pipe'}"]) == 0
    tensors = sum(len(tensors) for tensors in expected.values())
    assert f"task.init: {tensors} tensors of {tmp_path / 'pipe'} fit the model" in capsys.readouterr().out


def test_a_pipeline_missing_an_expert_is_one_line_naming_the_folders(tmp_path, capsys):
    _released_pipeline(tmp_path / "pipe", "diffusers")
    for file in (tmp_path / "pipe" / "transformer_2").iterdir():
        file.unlink()
    (tmp_path / "pipe" / "transformer_2").rmdir()
    assert main(["check", str(CONFIG), *SMALL, f"task.init={tmp_path / 'pipe'}"]) != 0
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and re.search(r"task.init .*transformer/ \+ transformer_2/", said[0]), said
    with pytest.raises(ConfigError, match=r"task.init .*transformer/ \+ transformer_2/"):  # training says the same
        _task(_config(tmp_path / "run", f"task.init={tmp_path / 'pipe'}")).build_model()


def test_a_static_ddp_graph_is_refused_by_check_in_one_line(capsys):
    """Each step leaves one expert unused, which a static DDP graph cannot express."""
    assert main(["check", str(CONFIG), *SMALL, "parallel.ddp_static_graph=true"]) != 0
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "parallel.ddp_static_graph assumes every step uses the same parameters" in said[0]


def _losses(out: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_a_run_resumes_bit_exactly_exports_both_experts_and_diffusers_predicts_the_same(tmp_path, capsys):
    ema = ["task.ema={decay: 0.5}", "optimizer.weight_decay=0.1", "scheduler.decay_steps=6", "checkpoint.interval=0"]
    straight = run_training(_config(tmp_path / "straight", "training.steps=6", *ema))
    assert straight["final_loss"] < straight["first_loss"]
    run_training(_config(tmp_path / "resumed", "training.steps=3", "checkpoint.interval=3", *ema[:3]))
    run_training(_config(tmp_path / "resumed", "training.steps=6", *ema))
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")
    averages = [torch.load(sorted((tmp_path / run / "checkpoints").glob("step-*"))[-1] / "state.pt",
                           weights_only=True)["task"]["ema_experts"] for run in ("straight", "resumed")]
    assert sorted(averages[0]) == ["high", "low"]
    for expert in ("high", "low"):
        assert averages[0][expert]["num_updates"] == averages[1][expert]["num_updates"] > 0
        assert all(torch.equal(a, b) for a, b in zip(averages[0][expert]["shadow"].values(),
                                                      averages[1][expert]["shadow"].values(), strict=True))
    assert averages[0]["high"]["num_updates"] + averages[0]["low"]["num_updates"] == 6

    out = tmp_path / "export"
    assert main(["convert", "mcore-to-hf", str(tmp_path / "straight" / "checkpoints"), str(out)]) == 0
    assert "boundary_ratio 0.875" in capsys.readouterr().out
    _, ours, _ = load_task_model(tmp_path / "straight" / "checkpoints")
    generator = torch.Generator().manual_seed(0)
    video, context = torch.randn(2, 3, 4, 16, 16, generator=generator), torch.randn(2, 8, 32, generator=generator)
    timestep = torch.tensor([900.0, 300.0])
    for expert, folder in (("high", "transformer"), ("low", "transformer_2")):
        theirs = WanTransformer3DModel.from_pretrained(out / folder).eval()
        with torch.no_grad():
            expected = ours.expert(expert).eval()(video, timestep, context)
            got = theirs(video, timestep, context, return_dict=False)[0]
        assert expected.abs().max() > 0 and (got - expected).abs().max() < 1e-5


def test_a_one_sided_sigma_range_leaves_the_other_expert_bitwise_untouched(tmp_path):
    run_training(_config(tmp_path / "run", "training.steps=3", "optimizer.weight_decay=0.1", "checkpoint.interval=0",
                         "task.flow_matching={shift: 3.0, sigma_range: [0.875, 1.0]}"))
    trained = load_file(str(sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1] / "model.safetensors"))
    config = _config(tmp_path / "fresh")
    torch.manual_seed(config.run.seed)
    task = _task(config)
    fresh = task.build_model().state_dict()
    assert all(torch.equal(trained[n], t) for n, t in fresh.items() if n.startswith("low."))
    assert any(not torch.equal(trained[n], t) for n, t in fresh.items() if n.startswith("high."))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_data_parallel_ranks_train_the_experts_like_one_process(tmp_path, strategy):
    """DDP finds the idle expert's parameters each step (their gradients stay None on every rank)."""
    from test_train_parallel import STEPS, assert_same_run, train

    assert {choose_expert(FlowMatchingConfig(shift=3.0), BOUNDARY, seed=0, step=s)[0]
            for s in range(1, STEPS + 1)} == {"high", "low"}  # both experts train in the compared steps
    experts = ["model.name=wan-tiny-experts", "model.overrides={}", "task.flow_matching={shift: 3.0}",
               "optimizer.weight_decay=0.1", "task.ema=null"]
    one = train(tmp_path / "one", *experts)
    assert_same_run(train(tmp_path / "two", f"parallel.strategy={strategy}", *experts, nproc=2), one,
                    range(1, STEPS + 1))
