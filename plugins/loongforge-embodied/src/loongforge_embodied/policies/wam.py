"""A world-action model in the manner of DreamZero: one Wan video DiT denoises the future camera frames and the action
chunk together, conditioned on the observed frame, the robot state and the task text.

The network is made of the diffusion plugin's Wan parts (``loongforge_diffusion.wan``: the 3D patch embedding, the
time embedding with its six AdaLN modulations, the text projection, ``WanBlock`` with Wan's 3D RoPE, the AdaLN output
head), so the world model is the video model the diffusion plugin trains, extended with state and action tokens
rather than a second architecture. What it adds:

- **Latents.** A frame's latent is the RGB frame in [-1, 1] average-pooled to ``latent_size`` pixels a side
  (:func:`encode_frames`), decoded by upsampling (:func:`decode_frames`). Wan's VAE is not part of this repository
  (``loongforge cache-latents`` runs diffusers' one), and at these frame sizes (32 pixels) a pooled frame is as much
  a latent as a VAE's 8x-compressed one would be, at no cost.
- **Tokens.** ``[state, observed latent patches, future latent patches, action steps]``. The observed frame and the
  future ones form one Wan video (frames on RoPE's time axis), so the model predicts the future as a continuation of
  what it sees; the state and action tokens are linear embeddings (actions with learned positions) whose RoPE
  rotation is the identity.
- **Time.** One flow-matching time per sample is shared by the future frames and the actions; the state and the
  observed frame are clean and get timestep 0 (per-token timesteps, as Wan 2.2 TI2V conditions on its first frame).
  Time follows the policies' convention (:mod:`~loongforge_embodied.policies.flow_matching`: 1 is noise), scaled to
  Wan's [0, 1000].
- **Outputs.** Wan's head gives the velocity of the future latent patches, a second head of the same form the
  velocity of the action steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loongforge_diffusion.wan.block import WanBlock
from loongforge_diffusion.wan.embeddings import PatchEmbed3D, TextProjection, TimeEmbedding
from loongforge_diffusion.wan.model import Head, init_from_scratch, unpatchify
from loongforge_diffusion.wan.rope import rope_table
from torch import nn

from loongforge_embodied.policies.prompt import BYTES
from loongforge_embodied.policies.wam_flavors import LATENT_CHANNELS, WamFlavor

#: Wan's timesteps run over [0, 1000]; flow time over [0, 1].
TIMESTEPS = 1000.0


def encode_frames(images: torch.Tensor, latent_size: int) -> torch.Tensor:
    """(..., 3, S, S) frames in [0, 1] -> (..., 3, latent_size, latent_size) latents in [-1, 1] (average pooling)."""
    flat = images.flatten(0, -4) * 2 - 1
    return F.adaptive_avg_pool2d(flat, latent_size).unflatten(0, images.shape[:-3])


def decode_frames(latents: torch.Tensor, size: int) -> torch.Tensor:
    """(..., 3, L, L) latents -> (..., size, size, 3) uint8 frames (nearest upsampling, so a latent pixel stays a
    visible square)."""
    flat = F.interpolate(latents.flatten(0, -4).float(), size=(size, size), mode="nearest")
    pixels = ((flat.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
    return pixels.unflatten(0, latents.shape[:-3])


class WorldActionModel(nn.Module):
    """``forward(inputs, noisy_video, noisy_actions, time) -> (video velocity, action velocity)``; see the module
    docstring.

    :param inputs: ``tokens`` (B, text_len) byte ids, ``state`` (B, max_state_dim) normalised and zero-padded,
        ``images`` (B, 1, 3, S, S) the observed frame in [0, 1].
    :param noisy_video: (B, 3, future_frames, L, L) noisy future latents; ``noisy_actions`` (B, H, max_action_dim).
    :param time: (B,) flow time, 1 = noise.
    """

    def __init__(self, flavor: WamFlavor) -> None:
        super().__init__()
        self.flavor = flavor
        d, p = flavor.dim, flavor.patch_size
        self.patch = (1, p, p)
        self.patch_embed = PatchEmbed3D(LATENT_CHANNELS, d, self.patch)
        self.time_embed = TimeEmbedding(flavor.freq_dim, d)
        self.byte_embed = nn.Embedding(1 + BYTES, flavor.text_dim)
        self.text_embed = TextProjection(flavor.text_dim, d)
        self.state_embed = nn.Linear(flavor.max_state_dim, d)
        self.action_embed = nn.Linear(flavor.max_action_dim, d)
        self.action_pos = nn.Parameter(torch.randn(flavor.max_horizon, d) * 0.02)
        self.blocks = nn.ModuleList(WanBlock(d, flavor.ffn_dim, flavor.heads, flavor.eps, cross_attn_norm=True,
                                             with_image=False) for _ in range(flavor.layers))
        self.video_head = Head(d, LATENT_CHANNELS * p * p, flavor.eps)
        self.action_head = Head(d, flavor.max_action_dim, flavor.eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Wan's initialisation for training from scratch, both heads' first velocities 0."""
        init_from_scratch(self, [self.video_head, self.action_head])

    def forward(self, inputs: dict[str, torch.Tensor], noisy_video: torch.Tensor, noisy_actions: torch.Tensor,
                time: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flavor = self.flavor
        horizon = noisy_actions.shape[1]
        if horizon > flavor.max_horizon:
            raise ValueError(f"an action chunk of {horizon} steps; the flavor has positions for {flavor.max_horizon} "
                             "(raise model.overrides.max_horizon)")
        observed = encode_frames(inputs["images"][:, 0], flavor.latent_size)[:, :, None]
        video = torch.cat([observed, noisy_video.to(observed.dtype)], dim=2)
        grid = tuple(n // p for n, p in zip(video.shape[2:], self.patch, strict=True))
        video_tokens = self.patch_embed(video)
        tokens = torch.cat([self.state_embed(inputs["state"])[:, None], video_tokens,
                            self.action_embed(noisy_actions) + self.action_pos[:horizon]], dim=1)
        observed_tokens = 1 + grid[1] * grid[2]  # the state and the observed frame: clean
        rope = _with_identity_rows(rope_table(flavor.dim // flavor.heads, grid, flavor.rope_theta, tokens.device),
                                   before=1, after=horizon)
        # two timesteps per sample (0 for clean tokens, t for noisy ones), embedded once each and then spread over
        # the tokens: the same values as embedding every token's timestep, at a fraction of the time MLP's work
        temb, time_mod = self.time_embed(torch.stack([torch.zeros_like(time), time * TIMESTEPS], dim=1))
        noisy = (torch.arange(tokens.shape[1], device=tokens.device) >= observed_tokens).long()
        temb, time_mod = temb[:, noisy], time_mod[:, noisy]
        context = self.text_embed(self.byte_embed(inputs["tokens"]))
        x = tokens
        for block in self.blocks:
            x = block(x, context, None, time_mod, rope)
        future = slice(observed_tokens, observed_tokens + video_tokens.shape[1] - grid[1] * grid[2])
        video_out = self.video_head(x[:, future], temb[:, future])
        actions_out = self.action_head(x[:, -horizon:], temb[:, -horizon:])
        return unpatchify(video_out, (grid[0] - 1, *grid[1:]), self.patch), actions_out


def _with_identity_rows(table: torch.Tensor, *, before: int, after: int) -> torch.Tensor:
    """The RoPE ``table`` (tokens, pairs, 2) with ``before`` and ``after`` rows of (cos 1, sin 0): tokens that are
    not video patches keep their features unrotated (their positions are learned)."""
    identity = torch.zeros(1, *table.shape[1:], dtype=table.dtype, device=table.device)
    identity[..., 0] = 1.0
    return torch.cat([identity.expand(before, -1, -1), table, identity.expand(after, -1, -1)])
