"""Hugging Face ``config.json`` <-> :class:`DecoderFlavor`, for the dense and MoE families we ship.

Reading refuses, with the file and key named, every switch our megatron models do not implement (another
family, a non-SiLU activation, attention or MLP biases Llama-style, sliding-window attention, router noise,
dense layers inside an MoE stack) instead of
converting weights into a model that would compute something else. Keys a config may omit get the
defaults of the transformers config class of that family, so a hand-trimmed ``config.json`` reads as
transformers would read it.

Writing starts from the source checkpoint's ``config.json`` when there is one (so token ids, generation
settings and unknown keys survive a round trip) and overwrites every architecture field from the flavor.
RoPE and the dtype are written in the style of that source; without one, in the pre-v5 style
(``rope_theta`` + ``rope_scaling``, ``torch_dtype``) that every transformers version reads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from loongforge.errors import ConfigError
from loongforge.interop.errors import InteropError
from loongforge.models.flavor import DecoderFlavor

CONFIG_JSON = "config.json"

#: family -> (``architectures[0]``, ``model_type``, defaults of keys a config.json may omit).
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "llama", {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6}),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6}),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6}),
    "mixtral": ("MixtralForCausalLM", "mixtral", {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
                                                  "num_local_experts": 8, "num_experts_per_tok": 2,
                                                  "router_aux_loss_coef": 0.001}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "qwen3_moe", {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                                                       "num_experts": 128, "num_experts_per_tok": 8,
                                                       "moe_intermediate_size": 768, "norm_topk_prob": False,
                                                       "router_aux_loss_coef": 0.001}),
}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
#: (key, value our models need) for switches the families' configs may carry.
_UNSUPPORTED = (("attention_bias", False), ("mlp_bias", False), ("use_sliding_window", False),
                ("router_jitter_noise", 0.0), ("decoder_sparse_step", 1), ("mlp_only_layers", []))
#: Families whose sliding window is a size (``None`` = off) rather than a ``use_sliding_window`` switch.
_WINDOW_BY_SIZE = ("mixtral",)
#: Our precision names <-> the ``torch_dtype`` strings of ``config.json``.
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """What a Hugging Face directory's ``config.json`` says: the flavor, the dtype and the raw mapping."""

    flavor: DecoderFlavor
    dtype: str  # fp32, bf16 or fp16
    raw: dict[str, Any]
    path: Path


def _family_of(raw: dict[str, Any], path: Path) -> str:
    archs = raw.get("architectures") or []
    by_arch = {arch: family for family, (arch, _, _) in FAMILIES.items()}
    if archs:
        if archs[0] in by_arch:
            return by_arch[archs[0]]
        found = f"architecture {archs[0]!r}"
    else:
        by_type = {model_type: family for family, (_, model_type, _) in FAMILIES.items()}
        if raw.get("model_type") in by_type:
            return by_type[raw["model_type"]]
        found = f"model_type {raw.get('model_type')!r}"
    supported = ", ".join(arch for arch, _, _ in FAMILIES.values())
    raise InteropError(f"{path}: {found} is not supported; supported: {supported}")


def read_hf_config(directory: str | Path) -> HFConfig:
    """Parse ``directory/config.json`` into a flavor; :class:`InteropError` names the file and key on failure."""
    path = Path(directory).expanduser() / CONFIG_JSON
    if not path.is_file():
        raise InteropError(f"{path}: not found (a Hugging Face checkpoint directory needs a config.json)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InteropError(f"{path}: cannot read: {exc}") from None
    if not isinstance(raw, dict):
        raise InteropError(f"{path}: must hold a JSON object")
    family = _family_of(raw, path)
    for key in _REQUIRED:
        if not isinstance(raw.get(key), int):
            raise InteropError(f"{path}: key {key!r} is missing or not an integer")
    if raw.get("hidden_act", "silu") != "silu":
        raise InteropError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    for key, needed in _UNSUPPORTED:
        if raw.get(key, needed) != needed:
            raise InteropError(f"{path}: {key}={raw[key]!r} is not supported for {family} (needs {needed!r})")
    if family in _WINDOW_BY_SIZE and raw.get("sliding_window") is not None:
        raise InteropError(f"{path}: sliding_window={raw['sliding_window']!r} is not supported for {family} "
                           "(needs null: full attention)")
    values = {**FAMILIES[family][2], "tie_word_embeddings": False, **{k: v for k, v in raw.items() if v is not None}}
    values["architectures"] = [FAMILIES[family][0]]  # also when the config names only its model_type
    try:
        from loongforge.models.hf_adapter import flavor_from_hf_config

        flavor = flavor_from_hf_config(SimpleNamespace(**values), family=family)
    except ConfigError as exc:
        raise InteropError(f"{path}: {exc}") from None
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    dtypes = {v: k for k, v in DTYPE_NAMES.items()}
    if dtype_name not in dtypes:
        raise InteropError(f"{path}: torch_dtype {dtype_name!r} is not supported; use one of {', '.join(dtypes)}")
    return HFConfig(flavor=flavor, dtype=dtypes[dtype_name], raw=raw, path=path)


def flavor_differences(actual: DecoderFlavor, expected: DecoderFlavor) -> list[str]:
    """``field a != b`` for every field where two flavors disagree (empty when they describe one model)."""
    return [
        f"{f.name} {getattr(actual, f.name)!r} != {getattr(expected, f.name)!r}"
        for f in dataclasses.fields(DecoderFlavor)
        if getattr(actual, f.name) != getattr(expected, f.name)
    ]


def hf_config_dict(flavor: DecoderFlavor, dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``flavor`` in ``dtype`` (fp32/bf16/fp16), keeping ``base``'s other keys."""
    if flavor.family not in FAMILIES:
        raise InteropError(
            f"model family {flavor.family!r} has no Hugging Face format; supported: {', '.join(FAMILIES)}"
        )
    architecture, model_type, _ = FAMILIES[flavor.family]
    out = dict(base or {})
    for key in ("rope_theta", "rope_scaling", "rope_parameters", "dtype", "torch_dtype", "transformers_version"):
        out.pop(key, None)
    out.update(
        architectures=[architecture],
        model_type=model_type,
        hidden_size=flavor.hidden_size,
        intermediate_size=flavor.ffn_hidden_size,
        num_hidden_layers=flavor.num_layers,
        num_attention_heads=flavor.num_attention_heads,
        num_key_value_heads=flavor.num_query_groups,
        # Mixtral's config writes ``head_dim: null`` for hidden // heads; keep that spelling when the source did.
        head_dim=None if flavor.head_dim is None and (base or {}).get("head_dim", 0) is None else flavor.kv_channels,
        vocab_size=flavor.vocab_size,
        max_position_embeddings=flavor.max_position_embeddings,
        rms_norm_eps=flavor.norm_eps,
        tie_word_embeddings=flavor.tie_word_embeddings,
        hidden_act="silu",
    )
    out["dtype" if base is not None and "dtype" in base else "torch_dtype"] = DTYPE_NAMES[dtype]
    if flavor.family != "qwen2":
        out["attention_bias"] = False
    if flavor.is_moe:
        out.update(_moe_config_keys(flavor, out))
    scaling = dict(flavor.rope_scaling) if flavor.rope_scaling else None
    if base is not None and "rope_parameters" in base:  # transformers >= 5 style
        out["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": flavor.rope_theta}
    else:
        out["rope_theta"] = flavor.rope_theta
        out["rope_scaling"] = scaling
    return out


def _moe_config_keys(flavor: DecoderFlavor, base: dict[str, Any]) -> dict[str, Any]:
    """The MoE part of ``config.json``: Mixtral names its expert width ``intermediate_size`` and its expert count
    ``num_local_experts``; Qwen3-MoE has ``moe_intermediate_size`` and ``num_experts`` (transformers 5 writes
    ``num_local_experts``: the key the source used is kept)."""
    keys: dict[str, Any] = dict(num_experts_per_tok=flavor.moe_router_topk,
                                router_aux_loss_coef=flavor.moe_aux_loss_coeff)
    if flavor.family == "mixtral":
        return keys | dict(num_local_experts=flavor.num_experts, intermediate_size=flavor.moe_ffn_hidden_size,
                           sliding_window=None, router_jitter_noise=0.0)
    count_key = "num_local_experts" if "num_local_experts" in base else "num_experts"
    return keys | {count_key: flavor.num_experts, "moe_intermediate_size": flavor.moe_ffn_hidden_size,
                   "norm_topk_prob": flavor.moe_norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": []}
