"""Transformers' ``*ForCausalLM`` as the reference implementation of core's decoder families (what
``DecoderFlavor.reference_implementation()`` returns): ``loongforge diff --reference`` runs a Hugging Face directory
there and compares it with LoongForge's model module by module.

The module pairs come from the same :class:`~loongforge.models.hf_layouts.HFNames` row the weight conversion uses:
a megatron module whose weight is one Hugging Face tensor is paired with that tensor's module (a norm, the output
projection, the embedding), and each layer, attention block and MLP with its Hugging Face parent. What has no
counterpart is left out: megatron's fused QKV and gate/up projections, and the attention block of a family whose
attention output is normed inside megatron's block but outside transformers' (Gemma-2's sandwich norms; its norm
is paired instead), Gemma's embedding (transformers scales it inside the module, megatron after) and a soft-capped
output layer (megatron's returns the capped logits).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongforge.models.family import ModulePair
from loongforge.models.flavor import DecoderFlavor


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def decoder_module_pairs(flavor: DecoderFlavor) -> tuple[ModulePair, ...]:
    """Megatron ``GPTModel`` modules of ``flavor`` and their ``*ForCausalLM`` counterparts, in forward order."""
    from loongforge.models.hf_layouts import hf_family, hf_names

    names = hf_names(flavor.family)
    # transformers scales Gemma's embedding inside its embedding module, megatron after it
    scaled = hf_family(flavor.family).embedding_scaled
    pairs = [] if scaled else [ModulePair("embedding.word_embeddings", names.embed)]  # batch-first, as the input
    if names.position is not None:
        pairs.append(ModulePair("embedding.position_embeddings", names.position))
    mlp_parent = names.fc2.rpartition(".")[0]
    for i in range(flavor.num_layers):
        ours, theirs = f"decoder.layers.{i}.", f"{names.layers}.{i}."
        layer = [("input_layernorm", names.input_norm)]
        if flavor.qk_layernorm:
            layer += [("self_attention.q_layernorm", names.q_norm), ("self_attention.k_layernorm", names.k_norm)]
        layer.append(("self_attention.linear_proj", names.proj))
        if names.post_attn_norm is None:
            layer.append(("self_attention", _parent(names.proj)))
        else:  # megatron's attention block ends with the sandwich norm transformers applies outside its own
            layer.append(("self_attention.post_norm", names.post_attn_norm))
        if names.mlp_norm is not None:
            layer.append(("pre_mlp_layernorm", names.mlp_norm))
        if not flavor.is_moe:
            if not flavor.gated_linear_unit:
                layer.append(("mlp.linear_fc1", names.fc1[0]))
            layer.append(("mlp.linear_fc2", names.fc2))
        layer.append(("mlp", mlp_parent))  # transformers 5 names every MoE block ``mlp`` in memory (Mixtral too)
        if names.post_mlp_norm is not None:
            layer.append(("post_mlp_layernorm", names.post_mlp_norm))
        layer.append(("", ""))
        pairs += [ModulePair((ours + a).rstrip("."), (theirs + b).rstrip("."), seq_first=True) for a, b in layer]
    pairs.append(ModulePair("decoder.final_layernorm", names.final_norm, seq_first=True))
    if flavor.final_logit_softcapping is None:  # else megatron's output layer returns the capped logits
        pairs.append(ModulePair("output_layer", dict(names.in_memory).get(names.lm_head + ".weight", names.lm_head)
                                .removesuffix(".weight"), seq_first=True, width=flavor.vocab_size))
    return tuple(pairs)


def load_transformers_model(auto_class: str, path: Path) -> Any:
    """The directory's model through transformers' ``auto_class`` in fp32 with eager attention -- the plainest
    arithmetic transformers has, the one the parity tests hold our models to -- in training mode (the tiny and
    published configs keep dropout at 0; a nonzero one is refused, since two draws of it never agree)."""
    import torch
    import transformers

    model = getattr(transformers, auto_class).from_pretrained(str(path), dtype=torch.float32,
                                                              attn_implementation="eager")
    model.train()
    dropouts = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Dropout) and module.p > 0]
    if dropouts:
        from loongforge.errors import InteropError

        raise InteropError(f"{path}: dropout {dropouts[0]} is on; the reference replay needs a model without it")
    return model


def padding_token(path: Path, *, section: str | None = None) -> tuple[int, ...]:
    """The directory's ``pad_token_id`` (in ``config.json``'s ``section``, e.g. ``text_config``, when it has one
    there): transformers builds the embedding with it as ``padding_idx``, whose row then gets no gradient."""
    import json

    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    nested = raw.get(section) if section is not None else None
    pad = (nested if isinstance(nested, dict) and "pad_token_id" in nested else raw).get("pad_token_id")
    return (pad,) if isinstance(pad, int) else ()


@dataclass(frozen=True)
class TransformersCausalLM:
    """Transformers' own model of one decoder flavor (:class:`~loongforge.models.family.ReferenceImplementation`)."""

    flavor: DecoderFlavor
    library: str = "transformers"

    def load(self, path: Path) -> Any:
        return load_transformers_model("AutoModelForCausalLM", path)

    def avoided_tokens(self, path: Path) -> tuple[int, ...]:
        return padding_token(path)

    def loss(self, model: Any, batch: Mapping[str, Any]) -> Any:
        """Mean next-token cross-entropy over the batch's labels (the MoE balancing loss left out, as LoongForge's
        side is traced without it)."""
        import torch.nn.functional as F

        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())

    def module_pairs(self) -> tuple[ModulePair, ...]:
        return decoder_module_pairs(self.flavor)

    def parameters(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The conversion's Hugging Face tensors as the module holds them: experts fused (transformers 5), names
        as loaded (GPT-NeoX's ``embed_out`` is ``lm_head``)."""
        from loongforge.models.hf_adapter import megatron_to_hf
        from loongforge.models.hf_layouts import hf_names

        renamed = dict(hf_names(self.flavor.family).in_memory)
        tensors = megatron_to_hf(dict(state), self.flavor, per_expert=False)
        return {renamed.get(name, name): tensor for name, tensor in tensors.items()}
