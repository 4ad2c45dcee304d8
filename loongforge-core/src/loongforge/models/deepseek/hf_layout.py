"""DeepSeek-V2/V3 Hugging Face tensors <-> the full (TP=PP=EP=1) megatron state dict of a DeepSeek chunk.

One rule per megatron tensor, from which both directions and the expected-shape table are derived (as core's
:mod:`loongforge.models.hf_adapter` does for its families), so they cannot disagree. The layout:

* attention (``self_attn.``): ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` (or ``q_proj`` without a query LoRA),
  ``kv_a_proj_with_mqa``/``kv_a_layernorm``/``kv_b_proj``, ``o_proj`` are megatron's ``linear_q_down_proj``/
  ``q_layernorm``/``linear_q_up_proj`` (``linear_q_proj``), ``linear_kv_down_proj``/``kv_layernorm``/
  ``linear_kv_up_proj``, ``linear_proj``, row for row: per head the query rows are ``[no-rope, rope]`` and
  ``kv_b_proj``'s rows ``[key no-rope, value]`` in both. A checkpoint with ``rope_interleave: false`` holds the
  rotated channels as halves ``(i, i + d/2)``, megatron's MLA as pairs ``(2i, 2i + 1)``: those rows are reordered.
* dense layers: ``mlp.gate_proj``/``up_proj`` -> ``linear_fc1`` (``[gate; up]``), ``down_proj`` -> ``linear_fc2``;
  MoE layers: ``mlp.gate.weight`` -> ``mlp.router.weight``, ``mlp.gate.e_score_correction_bias`` (V3) ->
  ``mlp.router.expert_bias``, experts one module each on disk (``mlp.experts.<e>.gate_proj``...) or fused in a
  transformers 5 module (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj``), shared experts
  ``mlp.shared_experts.*`` -> ``mlp.shared_experts.linear_fc1/linear_fc2``.
* multi-token prediction (DeepSeek-V3's format): block ``k`` is ``model.layers.<num_layers + k>.`` holding
  ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` (megatron's ``final_layernorm``) and a decoder layer's
  tensors (megatron's ``mtp.layers.<k>.transformer_layer.``), plus copies of the embedding and LM head
  (``embed_tokens``, ``shared_head.head``) that are written out and ignored when read (megatron shares the main
  model's).

Torch is imported by the functions that move tensors; the module itself only needs it for annotations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from loongforge.models.deepseek.flavor import DeepSeekFlavor

_EMBED, _LM_HEAD, _NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"


@dataclass(frozen=True)
class _Rule:
    """One megatron tensor and the HF tensor(s) it is made of: ``same``, ``gate_up`` (``[gate; up]``), ``vocab``
    (rows padded to megatron's vocabulary), ``rope_q`` / ``rope_kv`` (rotated rows reordered when the checkpoint
    does not interleave them: per head at the end of each head, or the last rows)."""

    megatron: str
    hf: tuple[str, ...]
    shape: tuple[int, ...]
    kind: str = "same"


def _layer_rules(flavor: DeepSeekFlavor, mg: str, hf: str, moe: bool) -> list[_Rule]:
    """The rules of one decoder layer (all but routed experts), megatron prefix ``mg``, HF prefix ``hf``."""
    h, heads = flavor.hidden_size, flavor.num_attention_heads
    q_rows = heads * flavor.qk_head_dim
    att, a = mg + "self_attention.", hf + "self_attn."
    rules = [_Rule(mg + "input_layernorm.weight", (hf + "input_layernorm.weight",), (h,))]
    if flavor.q_lora_rank is None:
        rules.append(_Rule(att + "linear_q_proj.weight", (a + "q_proj.weight",), (q_rows, h), "rope_q"))
    else:
        r = flavor.q_lora_rank
        rules += [_Rule(att + "linear_q_down_proj.weight", (a + "q_a_proj.weight",), (r, h)),
                  _Rule(att + "q_layernorm.weight", (a + "q_a_layernorm.weight",), (r,)),
                  _Rule(att + "linear_q_up_proj.weight", (a + "q_b_proj.weight",), (q_rows, r), "rope_q")]
    kv = flavor.kv_lora_rank
    rules += [
        _Rule(att + "linear_kv_down_proj.weight", (a + "kv_a_proj_with_mqa.weight",),
              (kv + flavor.qk_rope_head_dim, h), "rope_kv"),
        _Rule(att + "kv_layernorm.weight", (a + "kv_a_layernorm.weight",), (kv,)),
        _Rule(att + "linear_kv_up_proj.weight", (a + "kv_b_proj.weight",),
              (heads * (flavor.qk_nope_head_dim + flavor.v_head_dim), kv)),
        _Rule(att + "linear_proj.weight", (a + "o_proj.weight",), (h, heads * flavor.v_head_dim)),
        _Rule(mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), (h,)),
    ]
    if flavor.is_dsa:  # the lightning indexer, named as transformers' DeepseekV32Indexer names it
        n, d = flavor.index_n_heads or 0, flavor.index_head_dim
        ix, ax = att + "core_attention.indexer.", a + "indexer."
        rules += [_Rule(ix + "wq_b.weight", (ax + "wq_b.weight",), (n * d, flavor.q_lora_rank or h)),
                  _Rule(ix + "wk.weight", (ax + "wk.weight",), (d, h)),
                  _Rule(ix + "k_norm.weight", (ax + "k_norm.weight",), (d,)),
                  _Rule(ix + "k_norm.bias", (ax + "k_norm.bias",), (d,)),
                  _Rule(ix + "weights_proj.weight", (ax + "weights_proj.weight",), (n, h))]
    if not moe:
        f = flavor.ffn_hidden_size
        return rules + [
            _Rule(mg + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), (2 * f, h),
                  "gate_up"),
            _Rule(mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), (h, f)),
        ]
    rules.append(_Rule(mg + "mlp.router.weight", (hf + "mlp.gate.weight",), (flavor.num_experts or 0, h)))
    if flavor.moe_expert_bias:
        rules.append(_Rule(mg + "mlp.router.expert_bias", (hf + "mlp.gate.e_score_correction_bias",),
                           (flavor.num_experts or 0,)))
    shared = flavor.moe_shared_expert_intermediate_size
    if shared:
        s = hf + "mlp.shared_experts."
        rules += [
            _Rule(mg + "mlp.shared_experts.linear_fc1.weight", (s + "gate_proj.weight", s + "up_proj.weight"),
                  (2 * shared, h), "gate_up"),
            _Rule(mg + "mlp.shared_experts.linear_fc2.weight", (s + "down_proj.weight",), (h, shared)),
        ]
    return rules


def layers(flavor: DeepSeekFlavor) -> list[tuple[str, str, bool]]:
    """``(megatron prefix, HF prefix, is MoE)`` of every decoder layer, then of every MTP block's layer."""
    out = [(f"decoder.layers.{i}.", f"model.layers.{i}.", moe) for i, moe in enumerate(flavor.moe_layers)]
    out += [(f"mtp.layers.{k}.transformer_layer.", f"model.layers.{flavor.num_layers + k}.", flavor.is_moe)
            for k in range(flavor.mtp_num_layers)]
    return out


def rules(flavor: DeepSeekFlavor) -> list[_Rule]:
    """Every tensor of ``flavor`` but the routed experts, embedding first."""
    h, vocab = flavor.hidden_size, flavor.vocab_size
    out = [_Rule("embedding.word_embeddings.weight", (_EMBED,), (vocab, h), "vocab")]
    for mg, hf, moe in layers(flavor):
        out += _layer_rules(flavor, mg, hf, moe)
    for k in range(flavor.mtp_num_layers):
        mg, hf = f"mtp.layers.{k}.", f"model.layers.{flavor.num_layers + k}."
        out += [_Rule(mg + "enorm.weight", (hf + "enorm.weight",), (h,)),
                _Rule(mg + "hnorm.weight", (hf + "hnorm.weight",), (h,)),
                _Rule(mg + "eh_proj.weight", (hf + "eh_proj.weight",), (h, 2 * h)),
                _Rule(mg + "final_layernorm.weight", (hf + "shared_head.norm.weight",), (h,))]
    out.append(_Rule("decoder.final_layernorm.weight", (_NORM,), (h,)))
    if not flavor.tie_word_embeddings:
        out.append(_Rule("output_layer.weight", (_LM_HEAD,), (vocab, h), "vocab"))
    return out


def mtp_copies(flavor: DeepSeekFlavor) -> list[tuple[str, str]]:
    """``(HF name of the copy, HF name it copies)``: each MTP block's embedding and LM head, in DeepSeek's files."""
    head = _EMBED if flavor.tie_word_embeddings else _LM_HEAD
    out = []
    for k in range(flavor.mtp_num_layers):
        hf = f"model.layers.{flavor.num_layers + k}."
        out += [(hf + "embed_tokens.weight", _EMBED), (hf + "shared_head.head.weight", head)]
    return out


def _rope_rows(tensor: torch.Tensor, start: int, width: int, period: int, to_megatron: bool) -> torch.Tensor:
    """Reorder the ``width`` rotated rows that begin at ``start`` of every ``period`` rows: halves -> pairs
    (``to_megatron``) or back. Megatron's row ``2i`` is the checkpoint's row ``i``, ``2i + 1`` its ``i + width/2``."""
    import torch

    blocks = tensor.reshape(-1, period, *tensor.shape[1:])
    rope = blocks[:, start:start + width]
    if to_megatron:
        rope = torch.stack(rope.chunk(2, dim=1), dim=2).reshape(rope.shape)
    else:
        rope = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
    return torch.cat([blocks[:, :start], rope, blocks[:, start + width:]], dim=1).reshape(tensor.shape)


def _reorder(rule: _Rule, tensor: torch.Tensor, flavor: DeepSeekFlavor, to_megatron: bool) -> torch.Tensor:
    if flavor.rope_interleave or rule.kind not in ("rope_q", "rope_kv"):
        return tensor
    d = flavor.qk_rope_head_dim
    if rule.kind == "rope_q":
        return _rope_rows(tensor, flavor.qk_nope_head_dim, d, flavor.qk_head_dim, to_megatron)
    return _rope_rows(tensor, flavor.kv_lora_rank, d, flavor.kv_lora_rank + d, to_megatron)


def _fuse(rule: _Rule, parts: list[torch.Tensor], flavor: DeepSeekFlavor, rows: int) -> torch.Tensor:
    """HF tensors -> the megatron tensor of ``rule`` (concatenations, padding and row reorders only)."""
    import torch

    if rule.kind == "gate_up":
        return torch.cat(parts, dim=0)
    if rule.kind == "vocab" and parts[0].shape[0] != rows:
        return torch.cat([parts[0], parts[0].new_zeros(rows - parts[0].shape[0], *parts[0].shape[1:])])
    return _reorder(rule, parts[0], flavor, to_megatron=True)


def _split(rule: _Rule, tensor: torch.Tensor, flavor: DeepSeekFlavor) -> list[torch.Tensor]:
    """The exact inverse of :func:`_fuse`."""
    if rule.kind == "gate_up":
        return list(tensor.chunk(2, dim=0))
    if rule.kind == "vocab":
        return [tensor[: flavor.vocab_size]]
    return [_reorder(rule, tensor, flavor, to_megatron=False)]


def _expert_names(hf: str, expert: int) -> tuple[str, str, str]:
    prefix = f"{hf}mlp.experts.{expert}."
    return prefix + "gate_proj.weight", prefix + "up_proj.weight", prefix + "down_proj.weight"


def hf_to_megatron(tensors: dict[str, Any], flavor: DeepSeekFlavor, *, rows: int) -> dict[str, Any]:
    """The full megatron state dict from HF tensors (experts fused or one module each), vocabulary rows ``rows``."""
    import torch

    out = {rule.megatron: _fuse(rule, [tensors[n] for n in rule.hf], flavor, rows) for rule in rules(flavor)}
    for mg, hf, moe in layers(flavor):
        if not moe:
            continue
        if hf + "mlp.experts.gate_up_proj" in tensors:  # a transformers 5 module's state dict
            gate_up, down = tensors[hf + "mlp.experts.gate_up_proj"], tensors[hf + "mlp.experts.down_proj"]
        else:
            names = [_expert_names(hf, e) for e in range(flavor.num_experts or 0)]
            gate_up = [torch.cat([tensors[g], tensors[u]]) for g, u, _ in names]
            down = [tensors[d] for _, _, d in names]
        for e in range(flavor.num_experts or 0):
            out[f"{mg}mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
            out[f"{mg}mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
    return out


def megatron_to_hf(state: dict[str, Any], flavor: DeepSeekFlavor, *, per_expert: bool = True) -> dict[str, Any]:
    """HF tensors from a full megatron state dict: as checkpoints store them (``per_expert``, with the MTP blocks'
    embedding/head copies) or as a transformers 5 module holds them (experts fused, no copies). Fresh contiguous
    tensors, padded vocabulary rows dropped."""
    import torch

    out: dict[str, Any] = {}
    for rule in rules(flavor):
        out.update(zip(rule.hf, _split(rule, state[rule.megatron], flavor), strict=True))
    for mg, hf, moe in layers(flavor):
        if not moe:
            continue
        experts = range(flavor.num_experts or 0)
        fc1 = [state[f"{mg}mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in experts]
        fc2 = [state[f"{mg}mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in experts]
        if not per_expert:
            out[hf + "mlp.experts.gate_up_proj"], out[hf + "mlp.experts.down_proj"] = torch.stack(fc1), torch.stack(fc2)
            continue
        for e in experts:
            gate_name, up_name, down_name = _expert_names(hf, e)
            out[gate_name], out[up_name] = fc1[e].chunk(2, dim=0)
            out[down_name] = fc2[e]
    if per_expert:
        out.update({copy: out[source] for copy, source in mtp_copies(flavor)})
    return {name: t.detach().clone(memory_format=torch.contiguous_format) for name, t in out.items()}


def hf_shapes(flavor: DeepSeekFlavor, *, per_expert: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint of ``flavor`` (experts one module each, or fused) with its shape, derived by
    splitting shape-only megatron tensors with the conversion's own rules."""
    import torch

    shapes: dict[str, tuple[int, ...]] = {}
    for rule in rules(flavor):
        parts = _split(rule, torch.empty(rule.shape, device="meta"), flavor)
        shapes.update({name: tuple(part.shape) for name, part in zip(rule.hf, parts, strict=True)})
    h, e, m = flavor.hidden_size, flavor.num_experts or 0, flavor.moe_ffn_hidden_size or 0
    for _, hf, moe in layers(flavor):
        if not moe:
            continue
        if not per_expert:
            shapes.update({hf + "mlp.experts.gate_up_proj": (e, 2 * m, h), hf + "mlp.experts.down_proj": (e, h, m)})
            continue
        for expert in range(e):
            gate, up, down = _expert_names(hf, expert)
            shapes.update({gate: (m, h), up: (m, h), down: (h, m)})
    return shapes
