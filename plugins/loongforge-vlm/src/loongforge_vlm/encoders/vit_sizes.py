"""``ViTSizes``: what every plain ViT tower's flavor states (width, depth, heads, patches), checked once.

SigLIP and InternViT are both a patch embedding, learned positions and pre-norm blocks; they differ in their extra
switches (InternViT's norms, CLS token and tiling) and in what an image size must satisfy. Torch-free, like every
flavor, so ``loongforge list`` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.models.flavor import replace_fields


@dataclass(frozen=True)
class ViTSizes:
    """The sizes of a ViT tower; a subclass names itself in ``kind`` (errors read ``"<kind> flavor: ..."``) and adds
    its own size fields that must be positive to ``POSITIVE``."""

    kind: ClassVar[str] = "vit"
    POSITIVE: ClassVar[tuple[str, ...]] = ("dim", "ffn_dim", "num_heads", "num_layers", "patch_size", "image_size",
                                           "in_channels")

    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    patch_size: int
    image_size: int
    in_channels: int = 3
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in self.POSITIVE:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.kind} flavor: {name} must be positive, got {getattr(self, name)}")
        if self.dim % self.num_heads:
            raise ConfigError(f"{self.kind} flavor: dim ({self.dim}) is not divisible by num_heads ({self.num_heads})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def grid_size(self) -> int:
        """Whole patches per side at ``image_size``."""
        return self.image_size // self.patch_size

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch (channels x patch_size x patch_size, channel-major like the conv)."""
        return self.in_channels * self.patch_size ** 2

    def with_overrides(self, **overrides: Any) -> Any:
        """A copy with some fields changed (``num_layers=2`` for a smoke run); unknown names are errors."""
        return replace_fields(self, overrides, what=f"{self.kind} flavor")
