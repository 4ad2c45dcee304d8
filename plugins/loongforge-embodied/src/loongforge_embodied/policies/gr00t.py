"""A GR00T-N1.6-style vision-language-action policy in plain torch: a VL backbone whose features condition a DiT
action head through cross-attention, with per-embodiment state/action encoders and decoders, trained by flow
matching in GR00T's convention (:mod:`~loongforge_embodied.policies.gr00t_flow`).

What it shares with NVIDIA's GR00T N1.5/N1.6 (Isaac-GR00T's ``FlowmatchingActionHead`` and ``DiT``):

- The VL stream never sees the action chunk: image patch tokens and task text run through a bidirectional
  backbone, then a LayerNorm ("vlln") and ``vl_layers`` self-attention layers (N1.5's adapter; ``vl_layers=0``
  leaves the backbone's last layers to adapt instead), once per observation.
- States and actions go through "category-specific" layers: one weight matrix per embodiment id, picked per
  sample, so one model serves robots with different state/action meanings. The state encoder and action decoder
  are two-layer ReLU MLPs; the action encoder embeds each noisy action (W1), concatenates the sinusoidal embedding
  of the discretised timestep, and applies W2 + swish and W3.
- The DiT runs over [state token, learned future tokens, action tokens] (learned positions on the action tokens).
  Each block is AdaLayerNorm (scale/shift from the timestep embedding), attention and a GELU feed-forward; even
  blocks cross-attend from these tokens to the VL features only, odd blocks self-attend among them (N1.5's
  interleaved self-attention). The cross-attention blocks take the image patches and the task text in turn
  (N1.6's AlternateVLDiT; ``alternate_vl``), image first. An AdaLN-modulated output norm and projection, then the
  per-embodiment decoder, give the velocity of the action tokens.

Where it differs: GR00T's backbone is a 2B Eagle VLM (SigLIP, Qwen3 cut at a middle layer) fed by a tokenizer;
here a small patch-embedding transformer with RMSNorm and GeGLU layers (Pi0's, imported from
:mod:`~loongforge_embodied.policies.blocks`) reads byte ids (pad 0, byte + 1) and widths are tiny. Dropout (0.2 in
GR00T's DiT) is left out so training is deterministic, the per-embodiment weights start at a fan-in scale (see
:class:`CategoryLinear`), and state-relative action targets are a data choice left to the task.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_embodied.policies.blocks import GatedMLP, RMSNorm
from loongforge_embodied.policies.gr00t_flavors import Gr00tFlavor
from loongforge_embodied.policies.gr00t_flow import timestep_buckets
from loongforge_embodied.policies.prompt import BYTES, PAD


def sinusoid(t: torch.Tensor, dim: int, *, shift: int = 0, cos_first: bool = False) -> torch.Tensor:
    """(*t.shape, dim) sinusoidal embedding of timesteps ``t`` with frequencies ``10000**(-i / (dim/2 - shift))``.

    GR00T embeds its integer timestep twice: the action encoder with ``shift=0`` and sines first, the DiT's
    timestep encoder with diffusers' ``Timesteps(flip_sin_to_cos=True, downscale_freq_shift=1)`` (``shift=1``,
    cosines first).
    """
    half = dim // 2
    exponent = torch.arange(half, dtype=torch.float64, device=t.device) / (half - shift)
    angle = t.double()[..., None] * torch.exp(-math.log(10000.0) * exponent)
    parts = (angle.cos(), angle.sin()) if cos_first else (angle.sin(), angle.cos())
    return torch.cat(parts, dim=-1).float()


def _or_all(keys: torch.Tensor) -> torch.Tensor:
    """``keys`` (B, N) with the rows that have no key opened entirely (attending to everything, padding included,
    rather than to nothing, which softmax turns into NaN)."""
    return keys | ~keys.any(dim=1, keepdim=True)


class Attention(nn.Module):
    """Multi-head attention of ``x`` over itself or over ``context`` (cross-attention), keys masked by validity."""

    def __init__(self, dim: int, heads: int, head_dim: int, *, context_dim: int | None = None,
                 bias: bool = True) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.q = nn.Linear(dim, inner, bias=bias)
        self.kv = nn.Linear(context_dim or dim, 2 * inner, bias=bias)
        self.out = nn.Linear(inner, dim, bias=bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """``key_valid``: (B, N_keys) booleans (True = may be attended), or None for all keys."""
        k, v = self.kv(x if context is None else context).chunk(2, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (self.q(x), k, v))
        mask = None if key_valid is None else key_valid[:, None, None, :]
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2))


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` called like :class:`AdaLayerNorm` (the condition is ignored), so blocks need no branch."""

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x)


class AdaLayerNorm(nn.Module):
    """LayerNorm without weights of its own; scale and shift come from the (SiLU'd) timestep embedding."""

    def __init__(self, dim: int, cond_dim: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.modulation = nn.Linear(cond_dim, 2 * dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        scale, shift = self.modulation(F.silu(cond))[:, None].chunk(2, dim=-1)
        return self.norm(x) * (1 + scale) + shift


class Block(nn.Module):
    """GR00T's transformer block: norm, attention (cross-attention to ``context`` when ``context_dim`` is given),
    norm, GELU feed-forward, each with a residual. With ``cond_dim`` the first norm is an :class:`AdaLayerNorm`
    and the second has no weights (the DiT's blocks); without, both are affine LayerNorms (the VL layers)."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: int, eps: float, *,
                 context_dim: int | None = None, cond_dim: int | None = None) -> None:
        super().__init__()
        self.cross = context_dim is not None
        self.norm1 = AdaLayerNorm(dim, cond_dim, eps) if cond_dim else LayerNorm(dim, eps=eps)
        self.attention = Attention(dim, heads, head_dim, context_dim=context_dim)
        self.norm2 = LayerNorm(dim, eps=eps, elementwise_affine=not cond_dim)
        self.ff = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(approximate="tanh"),
                                nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None, context: torch.Tensor | None = None,
                key_valid: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.norm1(x, cond), context, key_valid)
        return x + self.ff(self.norm2(x))


class BackboneLayer(nn.Module):
    """A bidirectional pre-norm layer of the stand-in VLM (RMSNorm, bias-free attention, GeGLU)."""

    def __init__(self, flavor: Gr00tFlavor) -> None:
        super().__init__()
        w = flavor.width
        self.norm1 = RMSNorm(w, flavor.eps)
        self.attention = Attention(w, flavor.heads, flavor.head_dim, bias=False)
        self.norm2 = RMSNorm(w, flavor.eps)
        self.mlp = GatedMLP(w, flavor.mlp_ratio * w)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x)[0], key_valid=valid)
        return x + self.mlp(self.norm2(x)[0])


class CategoryLinear(nn.Module):
    """A linear layer with one weight matrix and bias per category (embodiment), chosen per sample.

    Weights start at ``randn / sqrt(n_in)``: GR00T draws ``0.02 * randn``, about that scale at its fan-ins (1024 to
    1536), but at this policy's small fan-ins 0.02 starves the action path (the flow loss of ``gr00t-tiny``-sized
    tests barely moved in 150 steps).
    """

    def __init__(self, categories: int, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(categories, n_in, n_out) / math.sqrt(n_in))
        self.bias = nn.Parameter(torch.zeros(categories, n_out))

    def forward(self, x: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        """(B, N, n_in) tokens of samples of categories (B,) -> (B, N, n_out)."""
        return torch.baddbmm(self.bias[category][:, None], x, self.weight[category])


class CategoryMLP(nn.Module):
    """Two :class:`CategoryLinear` layers with a ReLU between (GR00T's state encoder and action decoder)."""

    def __init__(self, categories: int, n_in: int, hidden: int, n_out: int) -> None:
        super().__init__()
        self.layer1 = CategoryLinear(categories, n_in, hidden)
        self.layer2 = CategoryLinear(categories, hidden, n_out)

    def forward(self, x: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        return self.layer2(F.relu(self.layer1(x, category)), category)


class ActionEncoder(nn.Module):
    """Noisy action tokens and their timestep -> DiT tokens, per embodiment: ``W3(swish(W2([W1 a, sin(tau)])))``."""

    def __init__(self, categories: int, action_dim: int, width: int) -> None:
        super().__init__()
        self.w1 = CategoryLinear(categories, action_dim, width)
        self.w2 = CategoryLinear(categories, 2 * width, width)
        self.w3 = CategoryLinear(categories, width, width)

    def forward(self, actions: torch.Tensor, buckets: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        a = self.w1(actions, category)
        tau = sinusoid(buckets, a.shape[-1]).to(a.dtype)[:, None].expand_as(a)
        return self.w3(F.silu(self.w2(torch.cat([a, tau], dim=-1), category)), category)


class Gr00tPolicy(nn.Module):
    """``forward(inputs, noisy_actions, time) -> velocity``; see the module docstring.

    :param inputs: ``tokens`` (B, text_len) byte ids (0 = padding, masked out as a key), ``state`` (B,
        max_state_dim) normalised and zero-padded, ``embodiment`` (B,) ids, and ``images`` (B, cameras, 3, S, S)
        in [0, 1] when the flavor has cameras.
    :param noisy_actions: (B, H, max_action_dim) ``x_t``; ``time``: (B,) flow time in GR00T's convention
        (0 = pure noise, 1 = data), seen by the model as ``int(t * 1000)``.
    """

    def __init__(self, flavor: Gr00tFlavor) -> None:
        super().__init__()
        self.flavor = flavor
        w, d, hid, e = flavor.width, flavor.dit_width, flavor.hidden, flavor.embodiments
        # VL stream
        if flavor.cameras:
            self.patch_embed = nn.Conv2d(3, w, flavor.patch_size, stride=flavor.patch_size)
            self.image_pos = nn.Parameter(torch.randn(flavor.cameras, flavor.patches, w) * 0.02)
        self.token_embed = nn.Embedding(1 + BYTES, w)
        self.text_pos = nn.Parameter(torch.randn(flavor.text_len, w) * 0.02)
        self.backbone = nn.ModuleList(BackboneLayer(flavor) for _ in range(flavor.depth))
        self.vlln = nn.LayerNorm(w, eps=flavor.eps)
        self.vl_layers = nn.ModuleList(Block(w, flavor.heads, flavor.head_dim, flavor.mlp_ratio, flavor.eps)
                                       for _ in range(flavor.vl_layers))
        # per-embodiment encoders and decoder, learned tokens
        self.state_encoder = CategoryMLP(e, flavor.max_state_dim, hid, d)
        self.action_encoder = ActionEncoder(e, flavor.max_action_dim, d)
        self.action_decoder = CategoryMLP(e, hid, hid, flavor.max_action_dim)
        if flavor.future_tokens:  # no zero-size parameters (sharding strategies need not handle them)
            self.future_tokens = nn.Parameter(torch.randn(flavor.future_tokens, d))
        self.action_pos = nn.Parameter(torch.randn(flavor.max_horizon, d))  # unit scale, as GR00T's nn.Embedding
        # DiT
        self.time_in = nn.Linear(flavor.time_channels, d)
        self.time_out = nn.Linear(d, d)
        self.dit = nn.ModuleList(
            Block(d, flavor.dit_heads, flavor.dit_head_dim, flavor.mlp_ratio, flavor.eps,
                  context_dim=None if i % 2 else w, cond_dim=d) for i in range(flavor.dit_depth))
        self.cross_blocks = sum(block.cross for block in self.dit)
        self.norm_out = AdaLayerNorm(d, d, flavor.eps)
        self.proj_out = nn.Linear(d, hid)

    def encode(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """VL features (B, N, width) of [image patches of every camera, text bytes], and the keys (B, N) booleans
        each cross-attention block of the DiT may attend to, in block order (see :meth:`cross_attention_keys`).

        Depends on the observation only (never on actions or time), so sampling could compute it once.
        """
        tokens = inputs["tokens"]
        x = self.token_embed(tokens) + self.text_pos[:tokens.shape[1]]
        text = tokens != PAD
        image = torch.zeros_like(text)
        if self.flavor.cameras:
            images = inputs["images"]
            batch, cameras = images.shape[:2]
            patches = self.patch_embed(images.flatten(0, 1) * 2 - 1).flatten(2).transpose(1, 2)  # SigLIP sees [-1, 1]
            patches = (patches.unflatten(0, (batch, cameras)) + self.image_pos[:cameras]).flatten(1, 2)
            x = torch.cat([patches, x], dim=1)
            image = torch.cat([text.new_ones(patches.shape[:2]), torch.zeros_like(text)], dim=1)
            text = torch.cat([text.new_zeros(patches.shape[:2]), text], dim=1)
        valid = _or_all(text | image)
        for layer in self.backbone:
            x = layer(x, valid)
        x = self.vlln(x)
        for layer in self.vl_layers:
            x = layer(x, key_valid=valid)
        return x, self.cross_attention_keys(valid, image, text)

    def cross_attention_keys(self, valid: torch.Tensor, image: torch.Tensor, text: torch.Tensor) -> list[torch.Tensor]:
        """The VL keys of each cross-attention block: all valid ones, or with ``alternate_vl`` (GR00T N1.6's
        AlternateVLDiT) the image patches in the 1st, 3rd ... cross-attention block and the text in the others.

        Why: with image and text keys in one softmax the action head of ``gr00t-tiny`` never learned to read the
        image (the task text, the same for every "reach the square" frame, took the attention; shuffling images
        across frames left the actions unchanged). A block whose only keys are the patches must read the image.
        Without cameras every block attends to the text.
        """
        if not (self.flavor.alternate_vl and self.flavor.cameras):
            return [valid] * self.cross_blocks
        text = _or_all(text)  # an empty task text: its blocks attend to every VL token, not to nothing
        return [image if j % 2 == 0 else text for j in range(self.cross_blocks)]

    def condition(self, buckets: torch.Tensor) -> torch.Tensor:
        """The DiT's timestep embedding (B, dit_width) of integer timesteps (B,)."""
        emb = sinusoid(buckets, self.flavor.time_channels, shift=1, cos_first=True).to(self.time_in.weight.dtype)
        return self.time_out(F.silu(self.time_in(emb)))

    def forward(self, inputs: dict[str, torch.Tensor], noisy_actions: torch.Tensor,
                time: torch.Tensor) -> torch.Tensor:
        features, keys = self.encode(inputs)
        return self.denoise(features, keys, inputs["state"], inputs["embodiment"], noisy_actions, time)

    def denoise(self, features: torch.Tensor, keys: list[torch.Tensor], state: torch.Tensor,
                embodiment: torch.Tensor, noisy_actions: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """The velocity (B, H, max_action_dim) of ``noisy_actions`` given VL features and keys from :meth:`encode`."""
        batch, horizon = noisy_actions.shape[:2]
        if horizon > self.flavor.max_horizon:
            raise ValueError(f"an action chunk of {horizon} steps; the flavor has positions for "
                             f"{self.flavor.max_horizon} (raise model.overrides.max_horizon)")
        buckets = timestep_buckets(time)
        actions = self.action_encoder(noisy_actions, buckets, embodiment) + self.action_pos[:horizon]
        tokens = [self.state_encoder(state[:, None], embodiment), actions]
        if self.flavor.future_tokens:
            tokens.insert(1, self.future_tokens.expand(batch, -1, -1))
        x = torch.cat(tokens, dim=1)
        cond = self.condition(buckets)
        cross_keys = iter(keys)
        for block in self.dit:
            x = block(x, cond, features, next(cross_keys)) if block.cross else block(x, cond)
        out = self.proj_out(self.norm_out(x[:, -horizon:], cond))
        return self.action_decoder(out, embodiment)
