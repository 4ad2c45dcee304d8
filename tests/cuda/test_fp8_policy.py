"""Measurements -> per-module monotone FP8 thresholds, and the policy JSON file (pure Python, no torch)."""

from __future__ import annotations

import json

import pytest
from loongforge_cuda.fp8.policy import (
    ModulePolicy,
    Policy,
    PolicyError,
    derive_policy,
    fp8_threshold,
    load_policy,
    policy_from_json,
    save_policy,
)


def _timings(speedups: dict[int, float]) -> dict[int, tuple[float, float]]:
    """``{tokens: (bf16_ms, fp8_ms)}`` with BF16/FP8 = the given speed-up."""
    return {t: (float(t), t / s) for t, s in speedups.items()}


def test_threshold_is_where_fp8_wins_from_then_on():
    assert fp8_threshold(_timings({512: 0.6, 1024: 0.9, 2048: 1.2, 4096: 1.5})) == 2048


def test_a_noisy_early_win_does_not_switch_fp8_on():
    # FP8 "wins" at 1024 by noise, loses at 2048, then wins for good from 4096.
    noisy = _timings({512: 0.7, 1024: 1.05, 2048: 0.95, 4096: 1.3, 8192: 1.6})
    assert fp8_threshold(noisy) == 4096
    # A loss at the largest count means no threshold at all, whatever happened below.
    assert fp8_threshold(_timings({512: 1.4, 1024: 1.3, 2048: 0.99})) is None


def test_never_and_always():
    assert fp8_threshold(_timings({512: 0.5, 1024: 0.8})) is None
    assert fp8_threshold(_timings({512: 1.1, 1024: 1.8})) == 512
    assert fp8_threshold({}) is None
    assert fp8_threshold(_timings({1024: 1.0})) is None  # a tie is not a win


def test_min_speedup_demands_a_margin():
    timings = _timings({512: 1.02, 1024: 1.08, 2048: 1.3})
    assert fp8_threshold(timings) == 512
    assert fp8_threshold(timings, min_speedup=1.05) == 1024
    assert fp8_threshold(timings, min_speedup=1.5) is None


def test_unsorted_input_is_handled():
    timings = _timings({4096: 1.5, 512: 0.6, 2048: 1.2, 1024: 0.9})
    assert fp8_threshold(timings) == 2048


def test_module_uses_fp8_at_and_above_its_threshold_scaled_for_experts():
    dense = ModulePolicy(4096, 28672, fp8_from_tokens=2048)
    assert not dense.use_fp8(1024) and dense.use_fp8(2048) and dense.use_fp8(10**6)
    expert = ModulePolicy(4096, 2048, fp8_from_tokens=2048, tokens_scale=8 / 128)  # top-8 of 128 experts
    assert expert.expected_tokens(16384) == 1024 and not expert.use_fp8(16384)
    assert expert.use_fp8(32768)
    assert not ModulePolicy(64, 64, fp8_from_tokens=None).use_fp8(10**9)


def _policy() -> Policy:
    shapes = {"mlp.linear_fc1": (4096, 28672, 1.0), "self_attention.linear_proj": (4096, 4096, 1.0)}
    measurements = {
        "mlp.linear_fc1": _timings({1024: 0.8, 4096: 1.3, 16384: 1.6}),
        "self_attention.linear_proj": _timings({1024: 0.5, 4096: 0.7, 16384: 0.9}),
    }
    return derive_policy(shapes, measurements, device="NVIDIA H100 80GB HBM3", recipe="blockwise", emulated=False)


def test_derive_save_load_round_trip(tmp_path):
    policy = _policy()
    assert policy.modules["mlp.linear_fc1"].fp8_from_tokens == 4096
    assert policy.modules["self_attention.linear_proj"].fp8_from_tokens is None
    path = save_policy(policy, tmp_path / "sub" / "policy.json")
    raw = json.loads(path.read_text())
    assert raw["format"] == "loongforge-fp8-policy" and raw["version"] == 1
    assert raw["modules"]["mlp.linear_fc1"]["measurements"][0] == {"tokens": 1024, "bf16_ms": 1024.0, "fp8_ms": 1280.0}
    loaded = load_policy(path)
    assert loaded.source == str(path)
    assert loaded.modules == policy.modules
    assert (loaded.device, loaded.recipe, loaded.emulated) == ("NVIDIA H100 80GB HBM3", "blockwise", False)
    assert not list(path.parent.glob("*.tmp"))


def test_missing_and_unparsable_files_name_the_file(tmp_path):
    with pytest.raises(PolicyError, match=r"nope\.json: FP8 policy file not found; create it with "
                                          r"loongforge fp8-measure"):
        load_policy(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PolicyError, match=r"bad\.json: not valid JSON"):
        load_policy(bad)


def _raw() -> dict:
    return {
        "format": "loongforge-fp8-policy", "version": 1, "device": "gpu", "recipe": "blockwise", "emulated": False,
        "modules": {"mlp.linear_fc1": {"in_features": 64, "out_features": 128, "tokens_scale": 1.0,
                                       "fp8_from_tokens": 2048,
                                       "measurements": [{"tokens": 2048, "bf16_ms": 2.0, "fp8_ms": 1.0}]}},
    }


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.update(version=2), r"p\.json: key version must be 1 .*, got 2"),
        (lambda r: r.pop("format"), r"p\.json: key format must be 'loongforge-fp8-policy', got 'missing'"),
        (lambda r: r.update(emulated="no"), r"p\.json: key emulated must be of type bool, got 'no'"),
        (lambda r: r.pop("recipe"), r"p\.json: key recipe is missing"),
        (lambda r: r["modules"]["mlp.linear_fc1"].update(in_features=True),
         r"key modules\.mlp\.linear_fc1\.in_features must be of type int, got True"),
        (lambda r: r["modules"]["mlp.linear_fc1"].update(fp8_from_tokens=-5),
         r"key modules\.mlp\.linear_fc1\.fp8_from_tokens must be a positive token count or null"),
        (lambda r: r["modules"]["mlp.linear_fc1"].pop("fp8_from_tokens"),
         r"key modules\.mlp\.linear_fc1\.fp8_from_tokens is missing"),
        (lambda r: r["modules"]["mlp.linear_fc1"].update(tokens_scale=0),
         r"key modules\.mlp\.linear_fc1\.tokens_scale must be a positive number"),
        (lambda r: r["modules"]["mlp.linear_fc1"]["measurements"][0].pop("fp8_ms"),
         r"key modules\.mlp\.linear_fc1\.measurements\[0\]\.fp8_ms is missing"),
    ],
)
def test_malformed_policy_names_file_and_key(edit, message):
    raw = _raw()
    edit(raw)
    with pytest.raises(PolicyError, match=message):
        policy_from_json(raw, "p.json")


def test_unknown_module_kind_names_the_file_and_what_it_has():
    policy = policy_from_json(_raw(), "p.json")
    assert policy.module("mlp.linear_fc1").use_fp8(4096)
    with pytest.raises(PolicyError, match=r"p\.json: no entry modules\.mlp\.linear_fc2 \(the policy has "
                                          r"mlp\.linear_fc1\).*re-run loongforge fp8-measure"):
        policy.module("mlp.linear_fc2")
