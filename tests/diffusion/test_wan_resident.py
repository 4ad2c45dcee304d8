"""``task.experts_resident: one`` (Wan 2.2 A14B, ``wan-tiny-experts``): one expert on the device at a time.

"On the device" is made observable on the CPU by a FAKE device backend (:class:`HostTracking`): the CPU backend whose
``host_empty_strided`` remembers every host buffer it hands out, so a tensor is on the "device" exactly when its
storage is not one of them. A residency that moved nothing (or forgot the optimizer state or the EMA) leaves the
waiting expert's tensors off those buffers, and the checks below fail; the both-resident run is checked to fail them.

- sampling with one resident equals both resident bitwise, and swaps once, at the boundary;
- training (with an EMA, resumed half way) equals both resident bitwise: losses, both experts' weights, AdamW state
  and averages; after every step the waiting expert's weights, moments and average are all host buffers and the
  trained one's none; the swaps are the changes of expert between consecutive steps, not the steps;
- ``task.expert_window`` groups the steps by expert without changing how often each trains.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from loongforge import hookimpl
from loongforge.devices.cpu import CPUBackend
from loongforge.train.run import run_training
from loongforge_diffusion.flow_matching import FlowMatchingConfig
from loongforge_diffusion.task import DiffusionTask
from loongforge_diffusion.wan.experts import EXPERTS, choose_expert, choose_grouped_expert
from safetensors.torch import load_file
from test_wan_experts import BOUNDARY, _config, _perturbed, _task


class HostTracking(CPUBackend):
    """FAKE accelerator: the CPU backend, remembering the storages of the host buffers it gives out. It holds every
    buffer, so no later tensor (of this run or the next) can be allocated at a freed buffer's address and be taken
    for host memory."""

    name = "cpu-host-tracking"
    host_storages: dict[int, torch.Tensor] = {}

    def host_empty_strided(self, size, stride, dtype):
        buffer = super().host_empty_strided(size, stride, dtype)
        HostTracking.host_storages[buffer.untyped_storage().data_ptr()] = buffer
        return buffer


class Plugin:
    """Registers the fake device and records, after each step, the trained expert, the swaps so far and each
    expert's bytes on the device."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    @hookimpl
    def loongforge_register_devices(self, registry):
        registry.register(HostTracking.name, HostTracking)

    @hookimpl
    def loongforge_on_step_end(self, trainer, step, metrics):
        task = trainer.engine.task
        self.steps.append({"expert": task.trained_expert,
                           "swaps": None if task.residency is None else task.residency.swaps,
                           "device": device_bytes(trainer.model, trainer.optimizer, task.ema)})


def _on_device(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() not in HostTracking.host_storages


def device_bytes(model, optimizer=None, ema=None) -> dict[str, dict[str, int]]:
    """Per expert, the bytes of its weights, AdamW state and EMA average on the "device" and in host buffers."""
    counts = {}
    for name in EXPERTS:
        params = list(model.expert(name).parameters())
        tensors = [p.data for p in params]
        if optimizer is not None:
            tensors += [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        if ema is not None:
            tensors += list((ema.shadows(name) or {}).values())
        on = sum(t.nbytes for t in tensors if _on_device(t))
        counts[name] = {"device": on, "host": sum(t.nbytes for t in tensors) - on}
    return counts


@pytest.fixture
def tracking():
    HostTracking.host_storages = {}
    yield HostTracking()
    HostTracking.host_storages = {}


def test_sampling_with_one_resident_expert_is_bitwise_both_and_swaps_once_at_the_boundary(tracking):
    config = _config(Path("unused"), "task.experts_resident=one")
    torch.manual_seed(0)
    both = _perturbed(_task(config).build_model(), seed=3).eval()
    task = _task(config)
    one = task.build_model().eval()
    one.load_state_dict(both.state_dict())
    task.place_model(one, tracking, torch.device("cpu"))
    served = []

    def check(module, _args, name):  # runs after the residency's own pre-hook
        counts = device_bytes(one)
        other = "low" if name == "high" else "high"
        assert counts[name]["host"] == 0 and counts[other]["device"] == 0 and counts[other]["host"] > 0, counts
        served.append(name)

    handles = [one.expert(name).register_forward_pre_hook(lambda m, a, name=name: check(m, a, name))
               for name in EXPERTS]
    context = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    kwargs = dict(shape=(2, 3, 2, 8, 8), shift=3.0, guidance=3.0, seed=1)
    expected = DiffusionTask().sample(both, {"context": context}, 8, **kwargs)
    got = DiffusionTask().sample(one, {"context": context}, 8, **kwargs)
    for handle in handles:
        handle.remove()
    assert torch.equal(got, expected)
    assert served[0] == "high" and served[-1] == "low" and len(served) == 16  # guided: two calls per step
    assert task.residency.swaps == 1


def _changes(experts: list[str], resident: str | None = None) -> int:
    """How often the expert changes between consecutive steps (and from ``resident``, on the device before them)."""
    return sum(a != b for a, b in pairwise([resident, *experts] if resident else experts))


def _losses(out: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _final(out: Path) -> tuple[dict, dict, dict]:
    last = sorted((out / "checkpoints").glob("step-*"))[-1]
    state = torch.load(last / "state.pt", weights_only=True)["task"]["ema_experts"]
    return (load_file(str(last / "model.safetensors")), torch.load(last / "optimizer.pt", weights_only=True), state)


def _assert_equal(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_training_with_one_resident_expert_is_bitwise_both_and_swaps_only_where_the_expert_changes(
        tmp_path, register_plugin, tracking):
    plugin = register_plugin(Plugin(), "resident-probe")
    common = ["device=cpu-host-tracking", "task.ema={decay: 0.5}", "optimizer.weight_decay=0.1",
              "scheduler.decay_steps=8"]
    run_training(_config(tmp_path / "both", "training.steps=8", "checkpoint.interval=0", *common))
    both_steps, plugin.steps = plugin.steps, []
    run_training(_config(tmp_path / "one", "training.steps=4", "checkpoint.interval=4",
                         "task.experts_resident=one", *common))
    run_training(_config(tmp_path / "one", "training.steps=8", "checkpoint.interval=0",
                         "task.experts_resident=one", *common))  # resumed from step 4
    one_steps = plugin.steps

    assert _losses(tmp_path / "one") == _losses(tmp_path / "both")
    _assert_equal(_final(tmp_path / "one"), _final(tmp_path / "both"))

    experts = [step["expert"] for step in one_steps]
    assert experts == [step["expert"] for step in both_steps]
    changes = _changes(experts, "high")  # residency starts with the high expert
    assert 0 < changes < len(experts) - 1 and {"high", "low"} == set(experts), experts
    # swaps counted per process: the resumed run restarts at 0 with the high expert resident
    assert [s["swaps"] for s in one_steps[:4]] == [_changes(experts[:n], "high") for n in range(1, 5)]
    assert one_steps[-1]["swaps"] == _changes(experts[4:], "high")
    for step in one_steps:
        trained, waiting = step["expert"], "low" if step["expert"] == "high" else "high"
        assert step["device"][waiting]["device"] == 0 and step["device"][waiting]["host"] > 0, step
        assert step["device"][trained]["host"] == 0, step
    # the both-resident run fails the same check: the check sees a residency that did nothing
    assert any(step["device"][name]["device"] > 0 for step in both_steps for name in EXPERTS
               if name != step["expert"])
    # at the last step the waiting expert's AdamW moments and average are host buffers too (not only its weights)
    last = one_steps[-1]
    weights = sum(p.nbytes for p in _task(_config(tmp_path / "x")).build_model().expert("high").parameters())
    assert last["device"]["low" if last["expert"] == "high" else "high"]["host"] >= 4 * weights


@pytest.mark.parametrize("window", [4, 8])
def test_an_expert_window_groups_the_steps_without_changing_how_often_each_expert_trains(window):
    objective = FlowMatchingConfig(shift=3.0)
    steps = 10 * window
    plain = [choose_expert(objective, BOUNDARY, 0, s)[0] for s in range(1, steps + 1)]
    grouped = [choose_grouped_expert(objective, BOUNDARY, 0, s, window) for s in range(1, steps + 1)]
    names = [name for name, _ in grouped]
    for first in range(0, steps, window):
        assert sorted(names[first:first + window]) == sorted(plain[first:first + window])
    changes = _changes(names)
    assert changes <= steps // window
    assert _changes(plain) > changes  # grouping is what cut them
    for name, restricted in grouped:
        low, high = restricted.sigma_range
        assert (low >= BOUNDARY) if name == "high" else (high < BOUNDARY)


def test_one_resident_expert_is_refused_for_a_single_dit_in_one_line(tmp_path):
    from loongforge.errors import ConfigError

    with pytest.raises(ConfigError, match="task.experts_resident: one needs a two-expert flavor"):
        _task(_config(tmp_path, "model.name=wan-tiny", "task.experts_resident=one"))
