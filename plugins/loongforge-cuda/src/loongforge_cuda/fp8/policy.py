"""Measurements of BF16 vs FP8 GEMM time -> a per-module FP8 policy, and its JSON file.

FP8 pays a fixed price per GEMM (quantising inputs, computing scales) and saves time proportional to the
work, so it loses on small token counts and wins on large ones. The benchmark (:mod:`.measure`) times every
module's GEMMs in both precisions over a ladder of token counts; here each module gets a *threshold*: the
smallest measured token count from which FP8 wins at that count **and every larger one**. Requiring the win
to hold all the way up makes one noisy fast FP8 sample below a real loss unable to switch FP8 on where it
would be slower. A module FP8 never beats at the largest count stays BF16.

Pure Python (no torch), so the policy logic and the file format are tested anywhere.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loongforge.errors import ConfigError

FORMAT = "loongforge-fp8-policy"
VERSION = 1


class PolicyError(ConfigError):
    """A policy file is missing, malformed or does not fit the model (the message names the file and key)."""


def fp8_threshold(timings: Mapping[int, tuple[float, float]], *, min_speedup: float = 1.0) -> int | None:
    """The smallest token count from which FP8 wins at every measured count, or None if it never does.

    :param timings: ``{tokens: (bf16_ms, fp8_ms)}``.
    :param min_speedup: FP8 "wins" at a count when ``bf16_ms / fp8_ms > min_speedup`` (``1.0``: faster at all;
        ``1.05`` demands a 5 % margin, which keeps FP8 off where the gain is within timing noise).
    """
    threshold = None
    for tokens in sorted(timings, reverse=True):
        bf16_ms, fp8_ms = timings[tokens]
        if not bf16_ms / fp8_ms > min_speedup:
            break
        threshold = tokens
    return threshold


@dataclass(frozen=True)
class ModulePolicy:
    """What the policy says for one module kind (e.g. ``mlp.linear_fc1``).

    ``tokens_scale`` converts the run's tokens per micro-batch into the rows this module's GEMM sees
    (1 for dense layers; ``topk / num_experts`` for a routed expert). ``fp8_from_tokens`` is the threshold
    (None: always BF16). ``timings`` are the measurements it came from, kept as evidence.
    """

    in_features: int
    out_features: int
    fp8_from_tokens: int | None
    tokens_scale: float = 1.0
    timings: dict[int, tuple[float, float]] = field(default_factory=dict)

    def expected_tokens(self, tokens_per_microbatch: int) -> int:
        return max(1, round(tokens_per_microbatch * self.tokens_scale))

    def use_fp8(self, tokens_per_microbatch: int) -> bool:
        """FP8 when this module's expected GEMM rows reach the threshold."""
        return self.fp8_from_tokens is not None and self.expected_tokens(tokens_per_microbatch) >= self.fp8_from_tokens


@dataclass(frozen=True)
class Policy:
    """Per-module FP8 decisions measured on one device with one FP8 recipe; ``source`` is the file it came from."""

    modules: dict[str, ModulePolicy]
    device: str
    recipe: str
    emulated: bool
    source: str = "<memory>"

    def module(self, kind: str) -> ModulePolicy:
        try:
            return self.modules[kind]
        except KeyError:
            raise PolicyError(
                f"{self.source}: no entry modules.{kind} (the policy has {', '.join(sorted(self.modules)) or 'none'});"
                " it was measured for another model: re-run loongforge fp8-measure for this one"
            ) from None


def derive_policy(
    shapes: Mapping[str, tuple[int, int, float]],
    measurements: Mapping[str, Mapping[int, tuple[float, float]]],
    *,
    device: str,
    recipe: str,
    emulated: bool,
    min_speedup: float = 1.0,
) -> Policy:
    """A policy from ``{module: {tokens: (bf16_ms, fp8_ms)}}`` and ``{module: (in, out, tokens_scale)}``."""
    modules = {}
    for name, timings in measurements.items():
        in_features, out_features, tokens_scale = shapes[name]
        modules[name] = ModulePolicy(
            in_features, out_features, fp8_threshold(timings, min_speedup=min_speedup), tokens_scale, dict(timings)
        )
    return Policy(modules, device=device, recipe=recipe, emulated=emulated)


def policy_to_json(policy: Policy) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "device": policy.device,
        "recipe": policy.recipe,
        "emulated": policy.emulated,
        "modules": {
            name: {
                "in_features": m.in_features,
                "out_features": m.out_features,
                "tokens_scale": m.tokens_scale,
                "fp8_from_tokens": m.fp8_from_tokens,
                "measurements": [{"tokens": t, "bf16_ms": b, "fp8_ms": f} for t, (b, f) in sorted(m.timings.items())],
            }
            for name, m in sorted(policy.modules.items())
        },
    }


def save_policy(policy: Policy, path: str | Path) -> Path:
    """Write ``policy`` as JSON (via a temporary file, so a reader never sees half a policy)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(policy_to_json(policy), indent=2) + "\n")
    tmp.replace(path)
    return path


def load_policy(path: str | Path) -> Policy:
    """Read a policy file; every problem raises :class:`PolicyError` naming the file and the key."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise PolicyError(f"{path}: FP8 policy file not found; create it with loongforge fp8-measure "
                          "--model <name> --out <file>") from None
    except json.JSONDecodeError as exc:
        raise PolicyError(f"{path}: not valid JSON ({exc})") from None
    return policy_from_json(raw, str(path))


def policy_from_json(raw: Any, source: str) -> Policy:
    """Validate the parsed JSON of a policy file (``source`` names it in errors)."""
    reader = _Reader(source)
    reader.require(isinstance(raw, dict), "", "a JSON object")
    reader.require(raw.get("format") == FORMAT, "format", f"'{FORMAT}'", raw.get("format", "missing"))
    reader.require(raw.get("version") == VERSION, "version", f"{VERSION} (the version this loongforge-cuda reads)",
                   raw.get("version", "missing"))
    device = reader.typed(raw, "device", str)
    recipe = reader.typed(raw, "recipe", str)
    emulated = reader.typed(raw, "emulated", bool)
    entries = reader.typed(raw, "modules", dict)
    modules = {name: _module_from_json(reader, f"modules.{name}", entry) for name, entry in entries.items()}
    return Policy(modules, device=device, recipe=recipe, emulated=emulated, source=source)


def _module_from_json(reader: _Reader, key: str, entry: Any) -> ModulePolicy:
    reader.require(isinstance(entry, dict), key, "an object")
    in_features = reader.typed(entry, "in_features", int, key)
    out_features = reader.typed(entry, "out_features", int, key)
    scale = reader.typed(entry, "tokens_scale", (int, float), key)
    reader.require(math.isfinite(scale) and scale > 0, f"{key}.tokens_scale", "a positive number")
    if "fp8_from_tokens" not in entry:
        raise PolicyError(f"{reader.source}: key {key}.fp8_from_tokens is missing")
    threshold = entry["fp8_from_tokens"]
    reader.require(threshold is None or (type(threshold) is int and threshold > 0), f"{key}.fp8_from_tokens",
                   "a positive token count or null (always BF16)", threshold)
    timings = {}
    for i, row in enumerate(entry.get("measurements", [])):
        where = f"{key}.measurements[{i}]"
        reader.require(isinstance(row, dict), where, "an object")
        timings[reader.typed(row, "tokens", int, where)] = (
            float(reader.typed(row, "bf16_ms", (int, float), where)),
            float(reader.typed(row, "fp8_ms", (int, float), where)),
        )
    return ModulePolicy(in_features, out_features, threshold, float(scale), timings)


@dataclass(frozen=True)
class _Reader:
    """Checks with errors of one shape: ``<file>: key <k> must be <what>, got <value>``."""

    source: str

    def require(self, ok: bool, key: str, what: str, value: Any = None) -> None:
        if not ok:
            got = "" if value is None else f", got {value!r}"
            where = f"key {key}" if key else "the top level"
            raise PolicyError(f"{self.source}: {where} must be {what}{got}")

    def typed(self, obj: dict, key: str, types: type | tuple[type, ...], parent: str = "") -> Any:
        full = f"{parent}.{key}" if parent else key
        if key not in obj:
            raise PolicyError(f"{self.source}: key {full} is missing")
        value = obj[key]
        # bool is an int in Python; a count or a size must not be true/false.
        ok = isinstance(value, types) and (types is bool or not isinstance(value, bool))
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        self.require(ok, full, f"of type {names}", value)
        return value
