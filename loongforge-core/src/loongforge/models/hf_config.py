"""Hugging Face ``config.json`` <-> :class:`DecoderFlavor`, for core's decoder families, each read from its row of
:data:`~loongforge.models.hf_layouts.FAMILIES` (no branch here names a family).

Reading (:class:`DecoderHFReader`, registered per architecture like any plugin's reader) refuses, with the file
and key named, every switch the row says our megatron models do not implement (a non-SiLU activation, attention or
MLP biases Llama-style, sliding-window attention, router noise, dense layers inside an MoE stack) instead of
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
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from loongforge.errors import InteropError
from loongforge.models.flavor import DecoderFlavor
from loongforge.models.hf_format import DTYPE_NAMES
from loongforge.models.hf_layouts import (
    FAMILIES,
    HF_ACTIVATION_NAMES,
    HF_ACTIVATIONS,
    HFFamily,
)

_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
#: Keys whose ``null`` switches a feature off rather than asking for the family default (Gemma-2).
_NULL_MEANS_OFF = ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window")


@dataclasses.dataclass(frozen=True)
class DecoderHFReader:
    """Core's reader of one decoder family's ``config.json`` (the :class:`~loongforge.models.family.HFReader` core
    registers under each architecture of :data:`FAMILIES`, as any plugin registers its own)."""

    family: str

    def read_config(self, raw: dict[str, Any], path: Path) -> DecoderFlavor:
        """The flavor ``raw`` describes; what the family's flavor cannot express is refused naming the key."""
        row = FAMILIES[self.family]
        _check_switches(raw, path, self.family, row)
        given = {k: v for k, v in raw.items() if v is not None or k in _NULL_MEANS_OFF}
        values = {"tie_word_embeddings": False, **row.defaults, **given}
        values["architectures"] = [row.architecture]  # also when the config names only its model_type
        from loongforge.models.hf_adapter import flavor_from_hf_config

        return flavor_from_hf_config(SimpleNamespace(**values), family=self.family)


def register_decoder_hf_architectures(registry: Any) -> None:
    """Register :class:`DecoderHFReader` for each family of :data:`FAMILIES` (its ``model_type`` as an alias)."""
    for family, row in FAMILIES.items():
        registry.register(row.architecture, DecoderHFReader(family), aliases=(row.model_type,),
                          description=f"core's {family} decoder")


def _check_switches(raw: dict[str, Any], path: Path, family: str, row: HFFamily) -> None:
    """Refuse, naming the file and key, what ``family``'s flavor cannot express."""
    for name in _REQUIRED:
        key = row.key(name)
        if not isinstance(raw.get(key), int) and not (row.intermediate_optional and name == "intermediate_size"):
            raise InteropError(f"{path}: key {key!r} is missing or not an integer")
    act_key = row.key("hidden_act")
    allowed = row.activations
    if allowed is not None and raw.get(act_key, allowed[0]) not in allowed:
        raise InteropError(f"{path}: {act_key} {raw[act_key]!r} is not supported for {family} "
                           f"(only {', '.join(map(repr, allowed))})")
    for key, needed in row.unsupported:
        if raw.get(key, needed) != needed:
            raise InteropError(f"{path}: {key}={raw[key]!r} is not supported for {family} (needs {needed!r})")
    if row.window_by_size and raw.get("sliding_window") is not None:
        raise InteropError(f"{path}: sliding_window={raw['sliding_window']!r} is not supported for {family} "
                           "(needs null: full attention)")


def hf_config_dict(flavor: DecoderFlavor, dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``flavor`` in ``dtype`` (fp32/bf16/fp16), keeping ``base``'s other keys.

    Keys are spelt as ``flavor``'s family's row spells them (:class:`~loongforge.models.hf_layouts.HFFamily`); keys
    the family does not have (GPT-2's ``num_key_value_heads``) are not written.
    """
    family = flavor.family
    if family not in FAMILIES:
        raise InteropError(f"model family {family!r} has no Hugging Face format; supported: {', '.join(FAMILIES)}")
    row = FAMILIES[family]
    out = dict(base or {})
    for key in ("rope_theta", "rope_scaling", "rope_parameters", "dtype", "torch_dtype", "transformers_version",
                "partial_rotary_factor", "rotary_pct", "rotary_emb_base"):
        out.pop(key, None)
    values = dict(
        hidden_size=flavor.hidden_size,
        intermediate_size=flavor.ffn_hidden_size,
        num_hidden_layers=flavor.num_layers,
        num_attention_heads=flavor.num_attention_heads,
        num_key_value_heads=flavor.num_query_groups,
        # Mixtral's config writes ``head_dim: null`` for hidden // heads; keep that spelling when the source did.
        head_dim=None if flavor.head_dim is None and (base or {}).get("head_dim", 0) is None else flavor.kv_channels,
        vocab_size=flavor.vocab_size,
        max_position_embeddings=flavor.max_position_embeddings,
        norm_eps=flavor.norm_eps,
        tie_word_embeddings=flavor.tie_word_embeddings,
        hidden_act=_activation_name(flavor, row, out.get(row.key("hidden_act"))),
    )
    intermediate_key = row.key("intermediate_size")
    if row.intermediate_optional and flavor.ffn_hidden_size == 4 * flavor.hidden_size \
            and (base or {}).get(intermediate_key, 0) is None:
        values["intermediate_size"] = None  # GPT-2's n_inner: null means 4 * hidden
    out.update(architectures=[row.architecture], model_type=row.model_type)
    out.update({row.key(name): value for name, value in values.items() if name not in row.absent_keys})
    out["dtype" if base is not None and "dtype" in base else "torch_dtype"] = DTYPE_NAMES[dtype]
    if row.attention_bias is not None:
        out["attention_bias"] = row.attention_bias
    if flavor.is_moe:
        out.update(_moe_config_keys(flavor, row, out))
    if row.write_extra is not None:
        out.update(row.write_extra(flavor))
    if flavor.position_embedding == "rope":
        out.update(_rope_keys(flavor, row, base))
    _check_expressed(flavor, out)
    return out


def _check_expressed(flavor: DecoderFlavor, written: dict[str, Any]) -> None:
    """Refuse a flavor the format cannot describe: ``written`` read back must be ``flavor`` again. A switch the
    family's reference hard-codes (Gemma scales embeddings by ``sqrt(hidden_size)``, whatever the flavor says) would
    otherwise be exported as another model, one that loads without a word and computes something else."""
    import dataclasses

    back = DecoderHFReader(flavor.family).read_config(written, Path("config.json"))
    # one model spelt two ways: a head width given or derived, an all-MoE model's unused dense MLP width
    spelling = {"head_dim": back.kv_channels == flavor.kv_channels, "ffn_hidden_size": flavor.is_moe,
                "hf_architecture": True}
    differences = [f"{f.name} {getattr(back, f.name)!r} != {getattr(flavor, f.name)!r}"
                   for f in dataclasses.fields(back)  # the decoder's fields (a subclass may add its own)
                   if getattr(back, f.name) != getattr(flavor, f.name) and not spelling.get(f.name)]
    if differences:
        raise InteropError(f"model {flavor.family}: its Hugging Face format ({written['architectures'][0]}) cannot "
                           f"express this flavor: {differences[0]} (written as the first, the flavor has the second)")


def _activation_name(flavor: DecoderFlavor, row: HFFamily, source: str | None) -> str:
    """The ``hidden_act`` to write: the source's spelling when it means the flavor's activation."""
    if source is not None and HF_ACTIVATIONS.get(source) == flavor.activation:
        return source
    return row.activation_names.get(flavor.activation, HF_ACTIVATION_NAMES[flavor.activation])


def _rope_keys(flavor: DecoderFlavor, row: HFFamily, base: dict[str, Any] | None) -> dict[str, Any]:
    """RoPE theta, scaling and partial-rotary fraction, in the style (transformers >= 5 or older) of ``base``."""
    scaling = dict(flavor.rope_scaling) if flavor.rope_scaling else None
    partial = {"partial_rotary_factor": flavor.rotary_percent} if flavor.rotary_percent != 1.0 else {}
    if base is not None and "rope_parameters" in base:  # transformers >= 5 style
        return {"rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": flavor.rope_theta,
                                    **partial}}
    if row.legacy_rope_keys is not None:  # GPT-NeoX's own names before transformers 5
        theta_key, fraction_key = row.legacy_rope_keys
        return {theta_key: flavor.rope_theta, fraction_key: flavor.rotary_percent}
    return {"rope_theta": flavor.rope_theta, "rope_scaling": scaling, **partial}


def _moe_config_keys(flavor: DecoderFlavor, row: HFFamily, base: dict[str, Any]) -> dict[str, Any]:
    """The MoE part of ``config.json``: Mixtral names its expert width ``intermediate_size`` and its expert count
    ``num_local_experts``; Qwen3-MoE has ``moe_intermediate_size`` and ``num_experts`` (transformers 5 writes
    ``num_local_experts``: the key the source used is kept)."""
    keys: dict[str, Any] = dict(num_experts_per_tok=flavor.moe_router_topk,
                                router_aux_loss_coef=flavor.moe_aux_loss_coeff)
    if row.moe_layout == "mixtral":
        return keys | dict(num_local_experts=flavor.num_experts, intermediate_size=flavor.moe_ffn_hidden_size,
                           sliding_window=None, router_jitter_noise=0.0)
    count_key = "num_local_experts" if "num_local_experts" in base else "num_experts"
    return keys | {count_key: flavor.num_experts, "moe_intermediate_size": flavor.moe_ffn_hidden_size,
                   "norm_topk_prob": flavor.moe_norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": []}
