"""Activation offload (``training.offload_activations``) moves memory, never numbers.

In one process the same 4-layer ``llama-debug`` trains 3 AdamW steps with and without offload: losses, gradient norms
and final weights must be bit for bit equal (also with selective recompute). The bytes the hooks move are checked
against an independent count (a plain ``saved_tensors_hooks`` pass that sums the distinct non-parameter storages each
chosen layer saves above the threshold), the trace must show every layer's tensors prefetched while the layer after
it runs its backward (before any is used), and the tracked device residency must stay below what the forward saved.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from loongforge.config.loader import load_config
from loongforge.config.offload_settings import check_offload
from loongforge.config.schema import RecomputeConfig
from loongforge.errors import ConfigError
from loongforge.models.decoder_model import build_model
from loongforge.models.llama import FLAVORS
from loongforge.models.recompute import recompute_kwargs
from loongforge.parallel.init import initialize_layout_independent
from loongforge.train.activation_offload import ActivationOffload, offload_targets

FLAVOR = FLAVORS["llama-debug"].with_overrides(num_layers=4)
SEQ, BATCH, STEPS, MIN_BYTES = 32, 2, 3, 1024
ALL = (0, 1, 2, 3)


def _batches():
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    for _ in range(STEPS):
        sample = torch.randint(0, FLAVOR.vocab_size, (BATCH, SEQ + 1), generator=gen)
        yield sample[:, :-1], positions, sample[:, 1:]


def _model(backend, recompute=None):
    model = build_model(FLAVOR, backend=backend, extra_config=recompute_kwargs(recompute, FLAVOR.num_layers))
    initialize_layout_independent([model], seed=3)
    model.train()
    return model


def _train(backend, layers=(), recompute=None):
    """(losses, grad norms, final weights, trace, per-step stats) of STEPS AdamW steps, offloading ``layers``."""
    model = _model(backend, recompute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trace: list[tuple[str, int]] = []
    offload = (ActivationOffload(offload_targets([model], frozenset(layers)), backend, MIN_BYTES, trace=trace)
               if layers else None)
    losses, norms, stats = [], [], []
    for tokens, positions, labels in _batches():
        optimizer.zero_grad()
        with offload.passes() if offload else contextlib.nullcontext():
            loss = model(tokens, positions, None, labels=labels).mean()
            loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        losses.append(loss.detach())
        if offload:
            stats.append(offload.stats)
            offload.take_metrics()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return losses, norms, weights, trace, stats


def _assert_bitwise(run, reference):
    losses, norms, weights = run[:3]
    assert all(torch.equal(a, b) for a, b in zip(losses, reference[0], strict=True)), (losses, reference[0])
    assert all(torch.equal(a, b) for a, b in zip(norms, reference[1], strict=True)), (norms, reference[1])
    assert weights.keys() == reference[2].keys()
    for name, weight in weights.items():
        assert torch.equal(weight, reference[2][name]), name


def _independent_saved_bytes(backend, layers):
    """Bytes of the distinct storages (parameters excepted, >= MIN_BYTES) each of ``layers`` saves in the first
    step's forward, counted by a plain pack hook that keeps every tensor where it is."""
    model = _model(backend)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current: list[int | None] = [None]
    per_layer: dict[int, dict[int, int]] = {}
    handles = []
    for index, layer in enumerate(model.decoder.layers):
        handles.append(layer.register_forward_pre_hook(lambda _m, _i, index=index: current.__setitem__(0, index)))
        handles.append(layer.register_forward_hook(lambda _m, _i, _o: current.__setitem__(0, None)))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if current[0] in layers and storage.nbytes() >= MIN_BYTES and storage.data_ptr() not in parameters:
            per_layer.setdefault(current[0], {})[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens, positions, labels = next(_batches())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens, positions, None, labels=labels).mean()
    for handle in handles:
        handle.remove()
    return sum(sum(storages.values()) for storages in per_layer.values())


@pytest.fixture(scope="module")
def plain(megatron_cpu_world):
    return _train(megatron_cpu_world)


@pytest.fixture(scope="module")
def offloaded(megatron_cpu_world):
    return _train(megatron_cpu_world, ALL)


def test_offload_trains_bit_for_bit_the_same(plain, offloaded):
    _assert_bitwise(offloaded, plain)


def test_offload_with_selective_recompute_is_bit_for_bit_the_same(megatron_cpu_world):
    recompute = RecomputeConfig(granularity="selective", modules=["core_attn", "mlp"])
    run = _train(megatron_cpu_world, (1, 2), recompute)
    _assert_bitwise(run, _train(megatron_cpu_world, (), recompute))
    assert run[4][0].moved_bytes > 0 and run[4][0].late_fetches == 0


def test_moved_bytes_match_an_independent_count(megatron_cpu_world, offloaded):
    stats = offloaded[4]
    expected = _independent_saved_bytes(megatron_cpu_world, set(ALL))
    assert expected > 0
    assert [s.moved_bytes for s in stats] == [expected] * STEPS
    assert _train(megatron_cpu_world, (2,))[4][0].moved_bytes == _independent_saved_bytes(megatron_cpu_world, {2})


def test_prefetch_runs_a_layer_ahead_of_use(offloaded):
    trace, stats = offloaded[3], offloaded[4]
    step = trace[: len(trace) // STEPS]  # every step traces the same
    assert trace == step * STEPS
    first = {}
    for position, event in enumerate(step):
        first.setdefault(event, position)
    for layer in (1, 2, 3):  # layer 4 (1-based) is still on the device when its backward starts
        prefetched = first[("prefetch", layer)]
        assert first[("backward", layer + 1)] < prefetched < first[("unpack", layer + 1)] < first[("unpack", layer)]
    assert ("prefetch", 4) not in first
    assert all(first[("backward", layer)] < first[("unpack", layer)] for layer in (1, 2, 3, 4))
    assert all(s.late_fetches == 0 and s.resident_bytes == 0 for s in stats)
    # At most the last two layers' storages are on the device at once, against all four without offload.
    assert 0 < stats[0].peak_resident_bytes <= stats[0].moved_bytes // 2


@pytest.mark.parametrize(("overrides", "message"), [
    (["training.offload_activations.layers=[4]"], r"training.offload_activations.layers must be layer indices in "
                                                   r"\[0, 3\] \(the model has 4 layers\) or 'all', got 4"),
    (["training.offload_activations.layers=[1, 1]"], "must name each layer once"),
    (["training.offload_activations.min_bytes=-1"], "'training.offload_activations.min_bytes' must be an integer >= 0"),
    (["training.offload_activations.layer=[1]"], "unknown key .*did you mean 'layers'"),
    (["training.offload_activations.layers=[1]", "training.compile=regional"],
     "does not combine with training.compile"),
    (["training.offload_activations.layers=all", "model.recompute.granularity=full"],
     "does not combine with model.recompute granularity full"),
])
def test_bad_settings_fail_in_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        check_offload(load_config(None, ["model.overrides.num_layers=4", *overrides]), 4)
    assert "\n" not in str(error.value)


def test_check_reports_and_validates_offload(tmp_path):
    from loongforge.train.preflight import preflight

    base = ["model.name=llama-debug", "model.overrides.num_layers=4", f"run.output_dir={tmp_path}"]
    lines = preflight(load_config(None, [*base, "training.offload_activations.layers=[0, 2]"]))
    assert "activation offload: 2 of 4 layer(s), saved storages of >= 1048576 bytes to host memory" in lines
    with pytest.raises(ConfigError, match="layers must be layer indices"):
        preflight(load_config(None, [*base, "training.offload_activations.layers=[9]"]))


def test_planner_counts_offloaded_layers_but_their_window():
    """``loongforge plan`` / ``parallel: auto``: offloaded layers keep no activations on the device beyond a window,
    on the stages that hold them: the last offloaded layer (its release waits for a next one), plus the layer its
    backward prefetches when every layer after it is offloaded too (measured: benchmarks/planner_long_context.py)."""
    from loongforge.planner.layouts import Candidate
    from loongforge.planner.memory import Workload, estimate_memory, layer_activation_elements

    flavor = FLAVORS["llama-debug"].with_overrides(num_layers=8)
    cand = Candidate(tp=1, pp=1, dp=1, micro_batch_size=2)
    plain = Workload(flavor, 256, "bf16", kernels="local")
    full_layer = sum(layer_activation_elements(flavor, cand).values()) * 256 * 2 * 2  # tokens x bf16 bytes
    kept = estimate_memory(plain, cand).terms["activations"]
    for offloaded, saved_layers in ((range(8), 6), ((3, 5, 6), 2), ((6, 7), 0), ((4,), 0)):
        workload = Workload(flavor, 256, "bf16", kernels="local", offloaded_layers=frozenset(offloaded))
        assert estimate_memory(workload, cand).terms["activations"] == pytest.approx(kept - saved_layers * full_layer)
    staged = Candidate(tp=1, pp=2, dp=1, micro_batch_size=2, num_microbatches=4)
    late = Workload(flavor, 256, "bf16", kernels="local", offloaded_layers=frozenset(range(4, 8)))
    memory = estimate_memory(late, staged)
    assert memory.per_stage[1] < estimate_memory(plain, staged).per_stage[1]
    assert memory.per_stage[0] == estimate_memory(plain, staged).per_stage[0]


def test_backends_give_the_offload_its_stream_and_host_buffers():
    """The CPU backend's host buffer is a separate tensor of the asked layout; a ``torch.cuda``-style backend hands
    out its module's current stream (what the copy stream waits on)."""
    from loongforge.devices.base import DeviceModuleBackend
    from loongforge.devices.cpu import CPUBackend

    buffer = CPUBackend().host_empty_strided((3, 4), (1, 3), torch.float32)
    assert (buffer.shape, buffer.stride(), buffer.dtype) == ((3, 4), (1, 3), torch.float32)

    class Module:
        stream = object()

        def current_stream(self):
            return self.stream

    class Accelerator(DeviceModuleBackend):
        name, device_type = "fake", "fake"
        probe = manual_seed = supports = spec_provider = None

        def device_module(self):
            return Module()

    assert Accelerator().current_stream() is Module.stream
