"""Entry point of the ``diffusion`` plugin.

Planned components (the diffusion issue fills them): Wan 2.1/2.2 video DiT, Qwen-Image MMDiT,
flow-matching training, latent caches, the Euler flow sampler.
"""

from __future__ import annotations

#: Shown by ``loongforge plugins`` until the plugin registers components of its own.
SUMMARY = "diffusion: Wan video DiT, Qwen-Image, flow matching (components arrive in 0.2)"
