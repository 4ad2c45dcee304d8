"""Crossing Hugging Face: the reader of ``Olmo2ForCausalLM`` directories and the adapter of OLMo-2's tensors.

Core keeps no table entry for OLMo-2. The plugin registers :class:`Olmo2Reader` under the architecture
(``loongforge_register_hf_architectures``), so ``model.load: hf:DIR``, ``loongforge convert hf-to-mcore`` and
``loongforge check`` read an OLMo-2 ``config.json`` through it; the flavor it returns hands out
:class:`Olmo2HFAdapter`, which checks and reads the tensors and writes them back (``convert mcore-to-hf``,
``checkpoint.save_hf``).

Torch-free at import (the reader runs in ``loongforge check``); the tensor methods import torch when called.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongforge.errors import InteropError
from loongforge.models.hf_format import DTYPE_NAMES

from loongforge_example_family.flavors import ARCHITECTURE, Olmo2Flavor, olmo2

MODEL_TYPE = "olmo2"
#: config.json keys that must be integers (no default in transformers' ``Olmo2Config`` we would trust).
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


class Olmo2Reader:
    """The :class:`loongforge.models.HFReader` of ``Olmo2ForCausalLM``: ``config.json`` -> :class:`Olmo2Flavor`.

    Keys a config may omit take ``Olmo2Config``'s defaults; a setting the family does not build (biases,
    attention dropout, another activation, scaled RoPE) is refused in one line naming the file and the key.
    """

    def read_config(self, raw: dict[str, Any], path: Path) -> Olmo2Flavor:
        for key in _REQUIRED:
            if not isinstance(raw.get(key), int):
                raise InteropError(f"{path}: key {key!r} is missing or not an integer")
        for key, needed in (("hidden_act", "silu"), ("attention_bias", False), ("attention_dropout", 0.0)):
            if raw.get(key, needed) != needed:
                raise InteropError(f"{path}: {key}={raw[key]!r} is not supported for olmo2 (needs {needed!r})")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}  # transformers >= 5, or older files
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise InteropError(f"{path}: rope_type {rope_type!r} is not supported for olmo2 (needs 'default')")
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        head_dim = raw.get("head_dim")
        return olmo2(
            num_layers=raw["num_hidden_layers"], hidden_size=hidden, ffn_hidden_size=raw["intermediate_size"],
            num_attention_heads=heads, num_query_groups=raw.get("num_key_value_heads") or heads,
            vocab_size=raw["vocab_size"], max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            norm_eps=float(raw.get("rms_norm_eps", 1e-5)), tie_word_embeddings=bool(raw.get("tie_word_embeddings")),
            head_dim=head_dim if head_dim and head_dim != hidden // heads else None,
        )


#: Megatron tensor (under ``decoder.layers.<i>.``) -> the OLMo-2 tensors (under ``model.layers.<i>.``) it holds.
#: Three names: megatron's fused QKV, interleaved per query group; two: megatron's ``[gate; up]``.
LAYER_TENSORS: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight"),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
    "post_feedforward_layernorm.weight": ("post_feedforward_layernorm.weight",),
}
#: Tensors whose rows are the vocabulary: megatron pads them (``padded_vocab_size``), Hugging Face does not.
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class Olmo2HFAdapter:
    """The :class:`loongforge.models.HFAdapter` of one :class:`Olmo2Flavor`: full (TP=1) megatron state dicts <->
    ``Olmo2ForCausalLM`` tensors, and its ``config.json``. Only reshapes, concatenations and slices, so a round
    trip is bitwise."""

    flavor: Olmo2Flavor

    def names(self) -> list[tuple[str, tuple[str, ...]]]:
        """``(megatron name, Hugging Face names)`` of every tensor, embedding first."""
        pairs = [("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
        for i in range(self.flavor.num_layers):
            pairs += [(f"decoder.layers.{i}.{mg}", tuple(f"model.layers.{i}.{n}" for n in hf))
                      for mg, hf in LAYER_TENSORS.items()]
        pairs.append(("decoder.final_layernorm.weight", ("model.norm.weight",)))
        if not self.flavor.tie_word_embeddings:
            pairs.append(("output_layer.weight", ("lm_head.weight",)))
        return pairs

    def to_hf(self, state: dict[str, Any]) -> dict[str, Any]:
        from loongforge.models.hf_adapter import split_qkv

        out = {}
        for megatron, hf in self.names():
            tensor = state[megatron]
            if len(hf) == 3:
                parts = split_qkv(tensor, self.flavor)
            elif len(hf) == 2:
                parts = tensor.chunk(2, dim=0)
            else:
                parts = (tensor[: self.flavor.vocab_size] if megatron in VOCAB_ROWS else tensor,)
            out.update(zip(hf, parts, strict=True))
        return {name: t.detach().clone().contiguous() for name, t in out.items()}

    def from_hf(self, tensors: dict[str, Any], *, padded_vocab_size: int | None = None) -> dict[str, Any]:
        import torch
        from loongforge.models.decoder_model import padded_vocab_size as tp1_padded
        from loongforge.models.hf_adapter import fuse_qkv

        rows = padded_vocab_size or tp1_padded(self.flavor.vocab_size)
        out = {}
        for megatron, hf in self.names():
            parts = [tensors[name] for name in hf]
            if len(parts) == 3:
                out[megatron] = fuse_qkv(*parts, self.flavor)
            elif len(parts) == 2:
                out[megatron] = torch.cat(parts, dim=0)
            elif megatron in VOCAB_ROWS:
                weight = parts[0]
                out[megatron] = torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])
            else:
                out[megatron] = parts[0]
        return out

    def tensor_shapes(self, stored: Collection[str]) -> dict[str, tuple[int, ...] | None]:
        f = self.flavor
        h, ffn, vocab = f.hidden_size, f.ffn_hidden_size, f.vocab_size
        q, kv = f.num_attention_heads * f.kv_channels, f.num_query_groups * f.kv_channels
        layer = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.q_norm.weight": (q,), "self_attn.k_norm.weight": (kv,),
                 "self_attn.o_proj.weight": (h, q), "post_attention_layernorm.weight": (h,),
                 "mlp.gate_proj.weight": (ffn, h), "mlp.up_proj.weight": (ffn, h), "mlp.down_proj.weight": (h, ffn),
                 "post_feedforward_layernorm.weight": (h,)}
        shapes: dict[str, tuple[int, ...] | None] = {"model.embed_tokens.weight": (vocab, h)}
        for i in range(f.num_layers):
            shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = None if f.tie_word_embeddings else (vocab, h)  # tied: may be stored, ignored
        return shapes

    def config_json(self, dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
        f = self.flavor
        dropped = ("rope_theta", "rope_scaling", "rope_parameters", "dtype", "torch_dtype", "transformers_version",
                   "head_dim")
        out = {k: v for k, v in (base or {}).items() if k not in dropped}
        out.update(
            architectures=[ARCHITECTURE], model_type=MODEL_TYPE, hidden_size=f.hidden_size,
            intermediate_size=f.ffn_hidden_size, num_hidden_layers=f.num_layers,
            num_attention_heads=f.num_attention_heads, num_key_value_heads=f.num_query_groups,
            vocab_size=f.vocab_size, max_position_embeddings=f.max_position_embeddings, rms_norm_eps=f.norm_eps,
            tie_word_embeddings=f.tie_word_embeddings, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
        )
        if f.head_dim is not None:
            out["head_dim"] = f.head_dim
        if base is not None and "rope_parameters" in base:  # the source's (transformers >= 5) style
            out["rope_parameters"] = {"rope_type": "default", "rope_theta": f.rope_theta}
        else:
            out.update(rope_theta=f.rope_theta, rope_scaling=None)
        out["dtype" if base is not None and "dtype" in base else "torch_dtype"] = DTYPE_NAMES[dtype]
        return out
