"""Our stand-in for the patched transformers that LeRobot 0.4.4's Pi0.5 expects (a git branch, not on PyPI).

LeRobot's ``PI05Pytorch`` runs on stock ``transformers`` 4.57 plus changes that openpi ships as
``transformers_replace`` and Hugging Face as a branch. Neither can be installed from a package registry, so the
parity harness applies this module's monkeypatches to the stock 4.57 classes before it builds the reference.
This is our code, written for the harness and modelled on openpi's adaRMS (``Dense(cond) -> scale, shift, gate``;
``normed * (1 + scale) + shift``; residual ``x + y * gate``); it is *not* the upstream patch. What it changes:

1. ``modeling_gemma.GemmaRMSNorm`` becomes :class:`AdaptiveGemmaRMSNorm`: ``forward(x, cond=None)`` returns
   ``(normed, gate)``. Without a conditioning width it is Gemma's RMSNorm (``x / rms(x) * (1 + weight)``, computed
   in float32) and the gate is ``None``; with one (``config.use_adarms``) it has no ``weight`` but a
   ``dense: Linear(cond_dim, 3 * dim)`` whose output splits into scale, shift and gate.
2. ``modeling_gemma._gated_residual(x, y, gate)``: ``x + y`` when ``gate`` is ``None``, else ``x + y * gate``.
3. ``GemmaDecoderLayer`` builds adaptive norms when ``config.use_adarms`` (conditioning width
   ``config.adarms_cond_dim``), and its forward takes ``adarms_cond`` and uses the gated residuals.
4. ``GemmaModel`` builds an adaptive final norm likewise; its forward takes ``adarms_cond``, passes an already
   prepared 4D additive mask through, and does *not* multiply the input embeddings by ``sqrt(hidden_size)``
   (Pi0.5 scales the language embeddings itself, and images are not scaled at all).
5. ``GemmaAttention`` with a cache and ``use_cache=False`` attends to the cached keys/values *without appending*
   its own (LeRobot's denoising steps reuse the prefix cache every step).
6. ``PaliGemmaModel.get_image_features`` drops the division by ``sqrt(text hidden size)`` (openpi's projection).
7. ``transformers.models.siglip.check.check_whether_transformers_replace_is_installed_correctly()`` exists and
   returns True, which is what ``PI05Pytorch.__init__`` asks before it builds anything.

Apply with :func:`install` (idempotent). Only the code paths that ``PI05Pytorch`` uses are replaced.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.gemma import modeling_gemma as mg
from transformers.models.paligemma import modeling_paligemma as mp


class AdaptiveGemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm, or adaptive RMSNorm (scale, shift, gate from a conditioning vector) when ``cond_dim``."""

    def __init__(self, dim: int, eps: float = 1e-6, cond_dim: int | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.cond_dim = cond_dim
        if cond_dim is None:
            self.weight = nn.Parameter(torch.zeros(dim))
        else:
            self.dense = nn.Linear(cond_dim, 3 * dim)
            nn.init.zeros_(self.dense.weight)
            nn.init.zeros_(self.dense.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.cond_dim is None:
            return (normed * (1.0 + self.weight.float())).type_as(x), None
        if cond is None:
            raise ValueError("adaptive RMSNorm needs the conditioning vector (adarms_cond)")
        modulation = self.dense(cond)
        if x.dim() == 3:
            modulation = modulation[:, None]
        scale, shift, gate = modulation.chunk(3, dim=-1)
        return (normed * (1.0 + scale.float()) + shift.float()).type_as(x), gate.type_as(x)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + y if gate is None else x + y * gate


def _cond_dim(config) -> int | None:
    return getattr(config, "adarms_cond_dim", None) if getattr(config, "use_adarms", False) else None


_original_layer_init = mg.GemmaDecoderLayer.__init__
_original_model_init = mg.GemmaModel.__init__
_original_init_weights = mg.GemmaPreTrainedModel._init_weights


def _layer_init(self, config, layer_idx: int) -> None:
    _original_layer_init(self, config, layer_idx)
    dim, eps, cond = config.hidden_size, config.rms_norm_eps, _cond_dim(config)
    self.input_layernorm = AdaptiveGemmaRMSNorm(dim, eps, cond)
    self.post_attention_layernorm = AdaptiveGemmaRMSNorm(dim, eps, cond)


def _model_init(self, config) -> None:
    _original_model_init(self, config)
    self.norm = AdaptiveGemmaRMSNorm(config.hidden_size, config.rms_norm_eps, _cond_dim(config))


def _init_weights(self, module: nn.Module) -> None:
    if isinstance(module, AdaptiveGemmaRMSNorm):
        if module.cond_dim is None:
            module.weight.data.zero_()
        return
    _original_init_weights(self, module)


def _layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                   use_cache=False, cache_position=None, position_embeddings=None, adarms_cond=None, **kwargs):
    residual = hidden_states
    hidden_states, gate = self.input_layernorm(hidden_states, cond=adarms_cond)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, past_key_values=past_key_values,
                                      use_cache=use_cache, cache_position=cache_position,
                                      position_embeddings=position_embeddings, **kwargs)
    hidden_states = gated_residual(residual, hidden_states, gate)
    residual = hidden_states
    hidden_states, gate = self.post_attention_layernorm(hidden_states, cond=adarms_cond)
    return gated_residual(residual, self.mlp(hidden_states), gate)


def _attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                       cache_position=None, use_cache=False, **kwargs):
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
    key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
    value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = mg.apply_rotary_pos_emb(query, key, cos, sin)
    if past_key_values is not None:
        if use_cache:
            key, value = past_key_values.update(key, value, self.layer_idx,
                                                {"sin": sin, "cos": cos, "cache_position": cache_position})
        else:
            cached_key, cached_value = past_key_values[self.layer_idx]
            key, value = torch.cat([cached_key, key], dim=2), torch.cat([cached_value, value], dim=2)
    kwargs.pop("position_ids", None)
    out, weights = mg.eager_attention_forward(self, query, key, value, attention_mask, scaling=self.scaling,
                                              dropout=0.0, **kwargs)
    return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


def _model_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                   inputs_embeds=None, use_cache=None, cache_position=None, adarms_cond=None, **kwargs):
    if inputs_embeds is None:
        inputs_embeds = self.embed_tokens(input_ids)
    if attention_mask is None or attention_mask.dim() != 4:
        raise ValueError("the Pi0.5 shim takes a prepared 4D additive attention mask")
    if use_cache and past_key_values is None:
        past_key_values = mg.DynamicCache(config=self.config)
    if position_ids is None:
        raise ValueError("the Pi0.5 shim takes explicit position ids")
    hidden_states = inputs_embeds
    position_embeddings = self.rotary_emb(hidden_states, position_ids)
    for layer in self.layers[: self.config.num_hidden_layers]:
        hidden_states = layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, use_cache=use_cache, cache_position=cache_position,
                              position_embeddings=position_embeddings, adarms_cond=adarms_cond)
    hidden_states, _ = self.norm(hidden_states, cond=adarms_cond)
    return BaseModelOutputWithPast(last_hidden_state=hidden_states,
                                   past_key_values=past_key_values if use_cache else None)


def _image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
    return self.multi_modal_projector(self.vision_tower(pixel_values).last_hidden_state)


def _check_module() -> types.ModuleType:
    module = types.ModuleType("transformers.models.siglip.check")
    module.check_whether_transformers_replace_is_installed_correctly = lambda: True
    return module


def install() -> None:
    """Apply every patch listed in the module docstring to the imported transformers (idempotent)."""
    mg.GemmaRMSNorm = AdaptiveGemmaRMSNorm
    mg._gated_residual = gated_residual
    mg.GemmaDecoderLayer.__init__ = _layer_init
    mg.GemmaDecoderLayer.forward = _layer_forward
    mg.GemmaAttention.forward = _attention_forward
    mg.GemmaModel.__init__ = _model_init
    mg.GemmaModel.forward = _model_forward
    mg.GemmaPreTrainedModel._init_weights = _init_weights
    mp.PaliGemmaModel.get_image_features = _image_features
    check = _check_module()
    sys.modules[check.__name__] = check
    import transformers.models.siglip as siglip

    siglip.check = check
