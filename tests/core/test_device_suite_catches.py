"""DeviceBackendSuite fails backends that break the promises it checks (so passing it means something)."""

from __future__ import annotations

import os

import pytest
from loongforge.devices.cpu import CPUBackend
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
