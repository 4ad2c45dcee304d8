"""``Pi05Flavor``: the sizes of one Pi0.5-style policy, and the table of named flavors.

Torch-free, because the plugin's collector hook registers these objects and ``loongforge list`` must stay instant.
Only tiny CPU flavors exist: the real Pi0.5 is a PaliGemma 3B backbone (SigLIP So400m + Gemma 2B, width 2048,
18 layers, 8 heads of 256) with a Gemma-300M action expert (width 1024), which this plain-torch policy does not
load (see :mod:`loongforge_embodied.policies.pi05` for how it differs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loongforge.errors import ConfigError
from loongforge.models.flavor import replace_fields


@dataclass(frozen=True)
class Pi05Flavor:
    """One policy. Both streams share the attention geometry (``heads`` x ``head_dim``), as Pi0's PaliGemma and
    action expert do, and differ in width; states and actions are zero-padded to ``max_state_dim`` /
    ``max_action_dim`` (Pi0 pads to 32) so one model fits robots with fewer dimensions."""

    width: int = 64                  # prefix stream (the VLM's) width
    expert_width: int = 32           # action expert width
    depth: int = 2                   # joint layers (prefix + expert weights each)
    vision_depth: int = 1            # image-only layers before the joint ones
    heads: int = 4
    head_dim: int = 16
    mlp_ratio: int = 4
    image_size: int = 16
    patch_size: int = 4
    cameras: int = 1
    text_len: int = 32               # task bytes kept (longer texts are cut)
    state_bins: int = 256            # Pi0.5 writes the state as 256-bin tokens
    max_state_dim: int = 8
    max_action_dim: int = 8
    rope_theta: float = 10000.0
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("width", "expert_width", "depth", "heads", "head_dim", "mlp_ratio", "image_size", "patch_size",
                     "cameras", "text_len", "state_bins", "max_state_dim", "max_action_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"pi05 flavor: {name} must be positive, got {getattr(self, name)}")
        if self.vision_depth < 0:
            raise ConfigError(f"pi05 flavor: vision_depth must be >= 0, got {self.vision_depth}")
        if self.head_dim % 2:
            raise ConfigError(f"pi05 flavor: head_dim {self.head_dim} must be even (rotary embedding)")
        if self.image_size % self.patch_size:
            raise ConfigError(f"pi05 flavor: image_size {self.image_size} is not a multiple of patch_size "
                              f"{self.patch_size}")

    @property
    def patches(self) -> int:
        """Image tokens per camera."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def prefix_len(self) -> int:
        """Image tokens of all cameras, then text bytes, then state tokens."""
        return self.cameras * self.patches + self.text_len + self.max_state_dim

    def with_overrides(self, **overrides: Any) -> Pi05Flavor:
        return replace_fields(self, overrides, what="pi05 flavor")

    def make_task(self, config: Any) -> Any:
        """What ``loongforge train`` runs for this flavor (the core trainer's task; see ``train_task``)."""
        from loongforge_embodied.train_task import PolicyTask

        return PolicyTask(self, config)


FLAVORS: dict[str, Pi05Flavor] = {
    "pi05-tiny": Pi05Flavor(),
    "pi05-small": Pi05Flavor(width=128, expert_width=64, depth=4, vision_depth=2, heads=4, head_dim=32,
                             image_size=32, patch_size=4, text_len=48, max_state_dim=32, max_action_dim=32),
}


def num_params(flavor: Pi05Flavor) -> int:
    """Parameter count, computed from the sizes (``loongforge list`` must not build the model)."""
    w, e, a, bins = flavor.width, flavor.expert_width, flavor.heads * flavor.head_dim, flavor.state_bins

    def stream(width: int, cond: int | None, output: bool) -> int:
        norm = cond * 3 * width + 3 * width if cond else width
        hidden = flavor.mlp_ratio * width
        return norm + 3 * width * a + ((a * width + norm + 3 * width * hidden) if output else 0)

    vision = 3 * flavor.patch_size ** 2 * w + w + flavor.cameras * flavor.patches * w
    vision += flavor.vision_depth * stream(w, None, True)
    embed = (1 + 256 + bins) * w
    layers = sum(stream(w, None, i < flavor.depth - 1) + stream(e, e, True) for i in range(flavor.depth))
    head = 2 * (flavor.max_action_dim * e) + e + flavor.max_action_dim + 2 * (e * e + e) + 2 * e * e + 2 * e
    return vision + embed + layers + head


def describe(flavor: Pi05Flavor) -> str:
    """One line for ``loongforge list``."""
    return (f"Pi0.5-style VLA policy (flow matching), {num_params(flavor) / 1e6:.2f}M params, {flavor.depth} joint "
            f"layers, width {flavor.width} / expert {flavor.expert_width}, {flavor.heads} heads x {flavor.head_dim}")
