"""DeviceBackendSuite fails backends that break the promises it checks (so passing it means something), among them
three that pass every other check and cannot train: a CPU backend declaring NCCL, one that skips megatron's CPU
patches, and one whose core attention is not a module."""

from __future__ import annotations

import os

import pytest
from loongforge.devices.cpu import CPUBackend
from loongforge.devices.cpu_spec import CPUSpecProvider
from loongforge.testing.device_suite import DeviceBackendSuite


class _OverridesUser(CPUBackend):
    def configure_env(self) -> None:
        os.environ["OMP_NUM_THREADS"] = "3"


class _PatchesTwice(CPUBackend):
    def apply_patches(self) -> None:
        import megatron.core.parallel_state as ps

        original = ps.get_tensor_model_parallel_world_size
        ps.get_tensor_model_parallel_world_size = lambda *a, **k: original(*a, **k)


class _ProbeMutatesEnv(CPUBackend):
    def probe(self) -> tuple[bool, str]:
        os.environ["LOONGFORGE_SUITE_PROBE_LEAK"] = "1"
        return True, "leaks"


class _LaxSupports(CPUBackend):
    def supports(self, feature: str) -> bool:
        return False


class _LossyRng(CPUBackend):
    def set_rng_state(self, state) -> None:
        """Forgets the state: resume would not be bit-exact."""


class _NcclOnCpu(CPUBackend):
    """Declares NCCL for CPU tensors."""

    dist_backend = "nccl"


class _SkipsCpuPatches(CPUBackend):
    def apply_patches(self) -> None:
        """Forgets megatron-core's CPU patches (its RNG tracker and device queries stay CUDA-only)."""


class _PlainAttention:
    """A class, so ``core_attention()`` still "is a type", but not a ``torch.nn.Module``: nothing runs forward."""

    def __init__(self, *args, **kwargs) -> None:
        self.config = kwargs.get("config")


class _AttentionNotAModuleProvider(CPUSpecProvider):
    def core_attention(self) -> type:
        return _PlainAttention


class _AttentionNotAModule(CPUBackend):
    def spec_provider(self) -> CPUSpecProvider:
        return _AttentionNotAModuleProvider()


@pytest.mark.parametrize(("mutant", "symptom"), [
    (_NcclOnCpu, "cannot start a world on dist_backend='nccl' declared by _NcclOnCpu"),
    (_SkipsCpuPatches, "CUDA"),  # unpatched, megatron asks torch.cuda (here: "Torch not compiled with CUDA")
    (_AttentionNotAModule, "_PlainAttention'> is not a subclass of torch.nn.Module"),
])
def test_backends_that_cannot_train_fail_the_training_check(mutant, symptom, tmp_path):
    with pytest.raises(AssertionError, match="cannot train one step of one transformer layer") as err:
        DeviceBackendSuite().test_trains_one_transformer_layer_one_step(mutant(), tmp_path)
    assert symptom in str(err.value), str(err.value)[-2000:]


@pytest.mark.parametrize("mutant", [_NcclOnCpu, _SkipsCpuPatches, _AttentionNotAModule])
def test_those_backends_pass_the_static_checks(mutant):
    """Why the training check is needed: the checks that do not train accept all three."""
    suite, backend = DeviceBackendSuite(), mutant()
    suite.test_identity(backend)
    suite.test_supports_answers_every_feature_and_rejects_unknown(backend)
    suite.test_spec_provider_has_megatron_backend_spec_provider_methods(backend)
    suite.test_apply_patches_is_idempotent(backend)


def test_override_of_a_user_variable_fails(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    with pytest.raises(AssertionError, match="changed or removed user settings"):
        DeviceBackendSuite().test_configure_env_never_overrides_user_values(_OverridesUser())
    assert os.environ["OMP_NUM_THREADS"] == "7", "the suite restores the environment it ran in"


def test_non_idempotent_patches_fail():
    import megatron.core.parallel_state as ps

    original = ps.get_tensor_model_parallel_world_size
    try:
        with pytest.raises(AssertionError, match="re-patched"):
            DeviceBackendSuite().test_apply_patches_is_idempotent(_PatchesTwice())
    finally:
        ps.get_tensor_model_parallel_world_size = original


def test_probe_with_side_effects_fails(monkeypatch):
    suite = DeviceBackendSuite()
    suite.backend_class = _ProbeMutatesEnv
    monkeypatch.delenv("LOONGFORGE_SUITE_PROBE_LEAK", raising=False)
    with pytest.raises(AssertionError, match="changed the environment"):
        suite.test_probe_is_cheap_and_side_effect_free()


def test_accepting_unknown_features_fails():
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        DeviceBackendSuite().test_supports_answers_every_feature_and_rejects_unknown(_LaxSupports())


def test_lossy_rng_state_fails():
    with pytest.raises(AssertionError):
        DeviceBackendSuite().test_rng_state_round_trips_bit_exactly(_LossyRng())


def test_device_checks_on_an_unavailable_backend_fail_with_guidance():
    class Unavailable(CPUBackend):
        def probe(self) -> tuple[bool, str]:
            return False, "no such card"

    suite = DeviceBackendSuite()
    with pytest.raises(pytest.fail.Exception, match="no such card.*override make_backend"):
        DeviceBackendSuite.usable_backend.__wrapped__(suite, Unavailable())
