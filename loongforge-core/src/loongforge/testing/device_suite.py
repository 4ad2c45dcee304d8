"""``DeviceBackendSuite``: the conformance tests every LoongForge device backend passes.

A hardware vendor subclasses it in its own test suite; pytest collects the inherited tests::

    from loongforge.testing.device_suite import DeviceBackendSuite
    from acme_loongforge.backend import AcmeBackend

    class TestAcmeBackend(DeviceBackendSuite):
        backend_class = AcmeBackend
        registry_name = "acme"          # the name the plugin registers in loongforge_register_devices

The checks are the promises the trainer relies on (see :class:`loongforge.devices.base.DeviceBackend`): the
probe is cheap and changes nothing, ``configure_env`` never overrides the user, ``apply_patches`` is
idempotent, ``supports`` answers every feature and rejects unknown ones, RNG state round-trips bit-exactly,
memory statistics carry the required keys, streams and events work, the spec provider has megatron's
``BackendSpecProvider`` methods, and explicit selection follows the probe.

Passing means the backend trains: :meth:`DeviceBackendSuite.test_trains_one_transformer_layer_one_step` builds one
transformer layer from the backend's ``spec_provider()`` and ``megatron_settings`` and trains it one step (finite
loss that drops, a gradient on every parameter, every parameter moved) in a one-process world the backend sets up as
a run does -- ``configure_env``, ``apply_patches``, ``set_device``, ``torch.distributed`` on its own
``dist_backend``, megatron's ``initialize_model_parallel(1, 1)`` (:mod:`loongforge.testing.one_step`). It runs in a
fresh interpreter, so megatron patches another backend applied earlier in the test process cannot make a backend
that skips its own pass; the interpreter builds the backend from :attr:`DeviceBackendSuite.training_backend` (an
import path; by default that of ``make_backend()``'s class).

*Limitation, stated rather than skipped:* a suite that wires the backend to a FAKE vendor module on a machine
without the hardware sets :attr:`DeviceBackendSuite.train_on_device` to False. A fake module runs no kernels and no
NCCL-style collective exists there, so the step then runs in-process on CPU tensors in a gloo world with the CPU
backend's megatron patches -- the layer is still built from this backend's spec provider and megatron settings (so a
spec that is not a module, or settings megatron rejects, still fail), and its ``dist_backend`` must still be a name
``torch.distributed`` knows; its patches and its device are only trained on the hardware.

Checks that touch the device (RNG, memory, streams, ``set_device``) need a backend whose probe says
"available". On a machine without the hardware, override :meth:`make_backend` to return the backend wired to a
fake vendor module -- as loongforge-cuda's and loongforge-xpu's own tests do -- so that the routing through
the vendor API is still tested; on the hardware, return the real backend. A device check run on an
unavailable backend fails and says so instead of silently passing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from loongforge.devices.base import FEATURES, DeviceBackend, MegatronSettings
from loongforge.devices.selection import DeviceSelectionError, select_backend
from loongforge.plugins import PluginHost
from loongforge.registry import Registry


class DeviceBackendSuite:
    """Subclass as ``TestSomething`` and set :attr:`backend_class` and :attr:`registry_name`."""

    #: The backend under test (a :class:`~loongforge.devices.base.DeviceBackend` subclass).
    backend_class: type[DeviceBackend] | None = None
    #: The name its plugin registers; the registered class must be ``backend_class`` or a base of it.
    registry_name: str = ""
    #: Modules the probe must not import (vendor runtimes whose import initialises or reads the environment).
    probe_must_not_import: tuple[str, ...] = ()
    #: Module-name prefixes whose namespaces ``apply_patches`` may patch; compared across a second call.
    patched_module_prefixes: tuple[str, ...] = ("megatron", "torch")
    #: Seconds a (warm) probe may take; ``auto`` selection and ``loongforge doctor`` probe every backend.
    probe_time_limit_s: float = 1.0
    #: Whether the training check runs on the backend's own device and ``dist_backend`` (see the module docstring
    #: for what False, for a backend wired to a FAKE vendor module, still checks).
    train_on_device: bool = True
    #: ``"module:factory"`` the training check's fresh interpreter builds the backend with; ``""``: the class of
    #: :meth:`make_backend`'s result (it must then be importable and constructible without arguments).
    training_backend: str = ""

    # -- hooks a vendor may override -----------------------------------------------------------------

    def make_backend(self) -> DeviceBackend:
        """The backend instance the checks run on (override to inject a fake vendor module)."""
        assert self.backend_class is not None, f"{type(self).__name__} must set backend_class"
        return self.backend_class()

    def draw_random(self, backend: DeviceBackend, n: int) -> Any:
        """``n`` numbers from the device generator that ``manual_seed``/``get_rng_state`` control."""
        import torch

        return torch.rand(n, device=backend.device(0))

    def device_initialized(self) -> bool:
        """Whether the device runtime has been initialised in this process (the probe must not do it)."""
        import torch

        return bool(torch.cuda.is_initialized())

    # -- fixtures ------------------------------------------------------------------------------------

    @pytest.fixture
    def backend(self) -> DeviceBackend:
        return self.make_backend()

    @pytest.fixture
    def usable_backend(self, backend: DeviceBackend) -> DeviceBackend:
        available, reason = backend.probe()
        if not available:
            pytest.fail(
                f"{type(backend).__name__} is not available here ({reason}); device checks need a usable backend: "
                f"run on the hardware, or override make_backend() to wire it to a fake vendor module"
            )
        return backend

    # -- identity and registration -------------------------------------------------------------------

    def test_identity(self, backend: DeviceBackend) -> None:
        assert backend.name and backend.name == backend.name.strip().lower(), backend.name
        assert isinstance(backend.priority, int)
        assert backend.device_type and backend.dist_backend
        assert backend.device(0).type == backend.device_type

    def test_registered_under_its_name(self) -> None:
        assert self.registry_name, f"{type(self).__name__} must set registry_name"
        entry = PluginHost().registry("device").entry(self.registry_name)
        registered = entry.load()
        assert isinstance(registered, type) and issubclass(self.make_backend().__class__, registered), registered
        assert registered.name == entry.name

    # -- selection and setup -------------------------------------------------------------------------

    def test_probe_is_cheap_and_side_effect_free(self) -> None:
        env_before = dict(os.environ)
        modules_before = set(sys.modules)
        initialised_before = self.device_initialized()
        backend = self.make_backend()
        first = backend.probe()
        started = time.perf_counter()
        second = backend.probe()
        elapsed = time.perf_counter() - started
        assert isinstance(first[0], bool) and isinstance(first[1], str) and first[1].strip(), first
        assert first == second, "probe must answer the same twice"
        assert dict(os.environ) == env_before, "constructing or probing a backend changed the environment"
        imported = sorted(m for m in set(sys.modules) - modules_before if m.split(".")[0] in self.probe_must_not_import)
        assert not imported, f"probe imported {imported}"
        assert self.device_initialized() == initialised_before, "probe initialised the device"
        assert elapsed < self.probe_time_limit_s, f"probe took {elapsed:.2f}s"

    def test_configure_env_never_overrides_user_values(self, backend: DeviceBackend) -> None:
        before = dict(os.environ)
        try:
            backend.configure_env()
            after = dict(os.environ)
            changed = {k: (v, after.get(k)) for k, v in before.items() if after.get(k) != v}
            assert not changed, f"configure_env changed or removed user settings: {changed}"
            defaults = {k: after[k] for k in set(after) - set(before)}
            os.environ.update({name: f"user-{name}" for name in defaults})  # a user who set every default
            backend.configure_env()
            overridden = [k for k in defaults if os.environ[k] != f"user-{k}"]
            assert not overridden, f"configure_env overrode user values of {overridden}"
            os.environ.update(defaults)  # and a second call is a no-op
            backend.configure_env()
            assert {k: os.environ[k] for k in defaults} == defaults
        finally:  # the defaults must not leak into later tests
            os.environ.clear()
            os.environ.update(before)

    def test_apply_patches_is_idempotent(self, backend: DeviceBackend) -> None:
        backend.apply_patches()
        patched = _namespace_fingerprint(self.patched_module_prefixes)
        backend.apply_patches()
        assert _namespace_fingerprint(self.patched_module_prefixes) == patched, "a second apply_patches re-patched"

    def test_explicit_selection_follows_the_probe(self, backend: DeviceBackend) -> None:
        registry = Registry("device")
        registry.register(backend.name, lambda: backend)
        available, reason = backend.probe()
        if available:
            chosen, why = select_backend(backend.name, registry, source="test")
            assert chosen is backend and reason in why
        else:
            with pytest.raises(DeviceSelectionError, match="is not available") as err:
                select_backend(backend.name, registry, source="test")
            assert reason in str(err.value)

    # -- capabilities and models ---------------------------------------------------------------------

    def test_supports_answers_every_feature_and_rejects_unknown(self, backend: DeviceBackend) -> None:
        answers = {feature: backend.supports(feature) for feature in FEATURES}
        assert all(isinstance(answer, bool) for answer in answers.values()), answers
        with pytest.raises(ValueError, match="unknown device feature"):
            backend.supports("no-such-feature")

    def test_spec_provider_has_megatron_backend_spec_provider_methods(self, backend: DeviceBackend) -> None:
        from megatron.core.models.backends import BackendSpecProvider

        provider = backend.spec_provider()
        missing = sorted(m for m in BackendSpecProvider.__abstractmethods__ if not callable(getattr(provider, m, None)))
        assert not missing, f"{type(provider).__name__} lacks {missing}"
        assert isinstance(provider.column_parallel_linear(), type)
        assert isinstance(provider.core_attention(), type)

    def test_megatron_settings_fit_megatron_configs(self, usable_backend: DeviceBackend) -> None:
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.transformer.transformer_config import TransformerConfig

        settings = usable_backend.megatron_settings("fp32")
        assert isinstance(settings, MegatronSettings) and settings.params_dtype == "fp32"
        fields = {f.name for f in dataclasses.fields(TransformerConfig)}
        assert set(settings.transformer_config_kwargs()) <= fields
        assert set(settings.ddp_config_kwargs()) <= {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
        with pytest.raises(ValueError):
            usable_backend.megatron_settings("fp32", no_such_option=True)
        if not usable_backend.supports("fp8"):
            with pytest.raises(ValueError):
                usable_backend.megatron_settings("fp8")

    def test_doctor_rows_are_text_and_side_effect_free(self, backend: DeviceBackend) -> None:
        env_before = dict(os.environ)
        initialised_before = self.device_initialized()
        rows = backend.doctor_rows()
        assert all(isinstance(item, str) and isinstance(value, str) for item, value in rows), rows
        assert dict(os.environ) == env_before
        assert self.device_initialized() == initialised_before

    # -- device operations (need a usable backend) ---------------------------------------------------

    def test_set_device_and_synchronize(self, usable_backend: DeviceBackend) -> None:
        usable_backend.set_device(0)
        usable_backend.synchronize()

    def test_rng_state_round_trips_bit_exactly(self, usable_backend: DeviceBackend) -> None:
        import torch

        usable_backend.manual_seed(1234)
        state = usable_backend.get_rng_state()
        first = self.draw_random(usable_backend, 64)
        self.draw_random(usable_backend, 7)
        usable_backend.set_rng_state(pickle.loads(pickle.dumps(state)))  # as it travels through a checkpoint
        assert torch.equal(self.draw_random(usable_backend, 64), first)
        usable_backend.manual_seed(1234)
        assert torch.equal(self.draw_random(usable_backend, 64), first)
        usable_backend.manual_seed(4321)
        assert not torch.equal(self.draw_random(usable_backend, 64), first)

    def test_memory_stats_have_required_keys(self, usable_backend: DeviceBackend) -> None:
        stats = usable_backend.memory_stats()
        assert {"allocated", "peak_allocated"} <= set(stats), stats
        assert all(isinstance(v, int) and v >= 0 for v in stats.values()), stats
        assert stats["peak_allocated"] >= stats["allocated"]

    def test_streams_and_events_are_usable(self, usable_backend: DeviceBackend) -> None:
        side, other = usable_backend.stream(), usable_backend.stream()
        with side:
            side.wait_stream(other)
        start, end = usable_backend.event(), usable_backend.event()
        start.record()
        end.record()
        end.wait()
        end.synchronize()
        assert end.query() is True
        assert start.elapsed_time(end) >= 0.0
        usable_backend.synchronize()

    def test_profiler_range_is_a_context_manager(self, usable_backend: DeviceBackend) -> None:
        with usable_backend.profiler_range("loongforge-suite"):
            pass

    # -- training ------------------------------------------------------------------------------------

    def test_trains_one_transformer_layer_one_step(self, usable_backend: DeviceBackend, tmp_path: Path) -> None:
        if self.train_on_device:
            result = _step_in_fresh_interpreter(self.training_backend or _factory_path(usable_backend), tmp_path)
        else:
            import torch.distributed as dist

            from loongforge.testing.one_step import run_step

            assert dist.Backend(usable_backend.dist_backend), usable_backend.dist_backend
            result = dataclasses.asdict(run_step(usable_backend, tmp_path, on_device=False))
        assert math.isfinite(result["loss"]) and math.isfinite(result["loss_after"]), result
        assert not result["without_grad"], f"parameters without a gradient: {result['without_grad']}"
        assert not result["unchanged"], f"parameters the optimizer step did not change: {result['unchanged']}"
        assert result["loss_after"] < result["loss"], f"one step did not lower the loss: {result}"


def _factory_path(backend: DeviceBackend) -> str:
    cls = type(backend)
    if "<locals>" in cls.__qualname__:
        raise AssertionError(f"{cls.__qualname__} is defined inside a function; the training check builds the "
                             "backend in a fresh interpreter: define it at module level or set training_backend")
    return f"{cls.__module__}:{cls.__qualname__}"


def _step_in_fresh_interpreter(factory: str, store_dir: Path) -> dict[str, Any]:
    """:func:`loongforge.testing.one_step.main` in a new process with this one's import path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-m", "loongforge.testing.one_step", factory, str(store_dir)],
                          capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise AssertionError(f"{factory} cannot train one step of one transformer layer:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _namespace_fingerprint(prefixes: tuple[str, ...]) -> dict[tuple[str, str], int]:
    """Identity of every attribute of the loaded modules under ``prefixes`` (what a patch would replace)."""
    fingerprint = {}
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in prefixes:
            continue
        for attr, value in list(vars(module).items()):
            fingerprint[(name, attr)] = id(value)
    return fingerprint
