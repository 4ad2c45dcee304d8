"""``WamFlavor``: the sizes of one world-action model (a DreamZero-style policy on Wan's DiT), and the named flavors.

Torch-free at import, like every flavor module (the plugin registers these objects and ``loongforge list`` must stay
instant). The model itself is :class:`loongforge_embodied.policies.wam.WorldActionModel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.models.listing import size_label

from loongforge_embodied.policies.flavor_base import PolicyFlavor
from loongforge_embodied.task_options import WorldActionTaskOptions

#: Channels of a frame latent (the pooled RGB frame, see ``wam.encode_frames``).
LATENT_CHANNELS = 3


@dataclass(frozen=True)
class WamFlavor(PolicyFlavor):
    """One world-action model: a stack of Wan DiT blocks (``dim`` wide, ``heads`` heads, ``layers`` deep) over the
    tokens of [state, the observed frame's latent, ``future_frames`` noisy future latents, the noisy action chunk],
    cross-attending to the task text. A camera frame (``image_size`` a side) becomes a ``latent_size`` latent, cut
    into ``patch_size`` patches. States and actions are zero-padded to ``max_state_dim`` / ``max_action_dim``;
    action tokens have learned positions for up to ``max_horizon`` steps."""

    cameras: int = 1
    image_size: int = 32
    latent_size: int = 8
    patch_size: int = 2              # latent pixels a side per token (Wan's spatial patch; 1 frame deep)
    future_frames: int = 2           # future frame latents denoised with the actions
    text_len: int = 16               # task bytes kept (longer texts are cut)
    text_dim: int = 32               # byte embedding width (Wan's text-encoder width)
    max_state_dim: int = 40
    max_action_dim: int = 4
    max_horizon: int = 16
    dim: int = 64
    heads: int = 4
    layers: int = 2
    ffn_dim: int = 256
    freq_dim: int = 64               # sinusoid channels of the time embedding (Wan: 256)
    rope_theta: float = 10000.0
    eps: float = 1e-6

    kind: ClassVar[str] = "wam"
    task_options: ClassVar[type | None] = WorldActionTaskOptions
    POSITIVE: ClassVar[tuple[str, ...]] = ("cameras", "latent_size", "future_frames", "text_len", "text_dim",
                                           "max_state_dim", "max_action_dim", "max_horizon", "dim", "heads", "layers",
                                           "ffn_dim", "freq_dim")

    def __post_init__(self) -> None:
        self.check_sizes()
        if self.cameras != 1:
            raise ConfigError(f"wam flavor: cameras must be 1 (the model predicts one camera's frames), got "
                              f"{self.cameras}")
        if self.image_size % self.latent_size or self.latent_size % self.patch_size:
            raise ConfigError(f"wam flavor: image_size {self.image_size} must be a multiple of latent_size "
                              f"{self.latent_size}, and that of patch_size {self.patch_size}")
        if self.dim % self.heads or (self.dim // self.heads) % 2 or self.freq_dim % 2:
            raise ConfigError(f"wam flavor: dim {self.dim} must split into {self.heads} heads of an even width "
                              f"(rotary embedding) and freq_dim {self.freq_dim} must be even")

    @property
    def patches(self) -> int:
        """Tokens per frame latent."""
        return (self.latent_size // self.patch_size) ** 2

    def build_policy(self) -> Any:
        from loongforge_embodied.policies.wam import WorldActionModel

        return WorldActionModel(self)

    def frame_inputs(self, task: str, state: Any) -> dict[str, Any]:
        """One frame's inputs besides images: task bytes ``tokens`` (text_len,) and the normalised ``state``
        zero-padded to (max_state_dim,)."""
        from loongforge_embodied.policies.prompt import padded_state, text_tokens

        return {"tokens": text_tokens(task, self.text_len), "state": padded_state(state, self.max_state_dim)}

    def flow_matching(self) -> Any:
        from loongforge_embodied.policies import flow_matching

        return flow_matching

    def make_task(self, config: Any) -> Any:
        from loongforge_embodied.wam_task import WorldActionTask

        return WorldActionTask(self, config)

    def num_params(self) -> int:
        """Parameter count, computed from the sizes (``loongforge list`` must not build the model)."""
        d, patch_values = self.dim, LATENT_CHANNELS * self.patch_size ** 2
        embeddings = (patch_values * d + d                                   # patch embedding (a 3D conv)
                      + (1 + 256) * self.text_dim                            # byte embedding
                      + self.text_dim * d + d + d * d + d                    # text projection
                      + self.freq_dim * d + d + d * d + d + d * 6 * d + 6 * d  # time embedding and modulation
                      + self.max_state_dim * d + d + self.max_action_dim * d + d + self.max_horizon * d)
        attention = 4 * (d * d + d) + 2 * d                                  # qkv + out, q/k RMSNorm
        cross = 4 * (d * d + d) + 2 * d + 2 * d                              # q, kv, out, q/k RMSNorm, input norm
        block = attention + cross + 2 * self.ffn_dim * d + self.ffn_dim + d + 6 * d
        heads = sum(d * out + out + 2 * d for out in (patch_values, self.max_action_dim))
        return embeddings + self.layers * block + heads

    def describe(self) -> str:
        """One line for ``loongforge list``."""
        return (f"world-action model on Wan DiT blocks (joint video-latent and action flow matching), "
                f"{size_label(self.num_params())} params, {self.layers} blocks of {self.heads} heads x "
                f"{self.dim // self.heads}, {self.future_frames} future frames of {self.latent_size}px latents")


FLAVORS: dict[str, WamFlavor] = {
    "wam-tiny": WamFlavor(),
}
