"""``QwenViTFlavor``: the hyperparameters of one Qwen2-VL / Qwen2.5-VL vision encoder, and the named flavors.

Torch-free, because the plugin's collector hook registers these objects and ``loongforge list`` must stay
instant. The real sizes carry the ``vision_config`` of the published Qwen checkpoints (Qwen2-VL-2B/7B-Instruct,
Qwen2.5-VL-3B/7B-Instruct); the ``*-tiny`` flavors are CPU sizes for parity tests. The two families differ in
the block (LayerNorm + QuickGELU MLP vs RMSNorm + SwiGLU MLP), the merger's norm, and Qwen2.5-VL's window
attention (every block not listed in ``full_attention_blocks`` attends only inside ``window_size`` pixel windows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from loongforge.errors import ConfigError
from loongforge.models.flavor import replace_fields

#: Encoder families: Qwen2-VL's ViT and Qwen2.5-VL's windowed one.
FAMILIES: tuple[str, ...] = ("qwen2-vl", "qwen2.5-vl")


@dataclass(frozen=True)
class QwenViTFlavor:
    """One Qwen vision tower, including the patch merger that projects merged patches to the LLM width.

    ``ffn_dim`` is the MLP hidden size (Qwen2-VL: ``mlp_ratio * dim``; Qwen2.5-VL: ``intermediate_size``).
    ``window_size`` (pixels) and ``full_attention_blocks`` only exist for Qwen2.5-VL.
    """

    family: str
    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    out_dim: int
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int | None = None
    full_attention_blocks: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"qwen vit flavor: family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("dim", "ffn_dim", "num_heads", "num_layers", "out_dim", "in_channels", "patch_size",
                     "temporal_patch_size", "spatial_merge_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"qwen vit flavor: {name} must be positive, got {getattr(self, name)}")
        if self.dim % self.num_heads:
            raise ConfigError(f"qwen vit flavor: dim ({self.dim}) is not divisible by num_heads ({self.num_heads})")
        if self.head_dim % 4:
            raise ConfigError(f"qwen vit flavor: head dim {self.head_dim} must be a multiple of 4 for the 2D RoPE")
        if self.family == "qwen2-vl" and (self.window_size is not None or self.full_attention_blocks):
            raise ConfigError("qwen vit flavor: window attention (window_size, full_attention_blocks) is "
                              "Qwen2.5-VL only")
        if self.family == "qwen2.5-vl":
            if self.window_size is None or self.window_size < self.merge_patch_pixels:
                raise ConfigError(f"qwen vit flavor: qwen2.5-vl needs window_size >= patch_size * spatial_merge_size "
                                  f"({self.merge_patch_pixels}), got {self.window_size}")
            outside = [i for i in self.full_attention_blocks if not 0 <= i < self.num_layers]
            if outside:
                raise ConfigError(f"qwen vit flavor: full_attention_blocks {outside} outside 0..{self.num_layers - 1}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened input patch (``pixel_values.shape[-1]``)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_patch_pixels(self) -> int:
        """Pixel side of one merged token (``patch_size * spatial_merge_size``)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def merge_unit(self) -> int:
        """Patches merged into one LLM token (``spatial_merge_size ** 2``)."""
        return self.spatial_merge_size ** 2

    @property
    def windowed(self) -> bool:
        return self.window_size is not None

    @property
    def gated_mlp(self) -> bool:
        """Qwen2.5-VL blocks use a SwiGLU MLP and RMSNorm; Qwen2-VL a QuickGELU MLP and LayerNorm."""
        return self.family == "qwen2.5-vl"

    def with_overrides(self, **overrides: Any) -> QwenViTFlavor:
        """A copy with some fields changed (``num_layers=2`` for a smoke run); unknown names are errors."""
        return replace_fields(self, overrides, what="qwen vit flavor")


def parameter_shapes(flavor: QwenViTFlavor) -> dict[str, tuple[int, ...]]:
    """Every parameter of :class:`~loongforge_vlm.encoders.qwen_vit.QwenViT` and its shape (torch-free).

    The adapter checks state dicts against this table, and :func:`num_params` sums it.
    """
    d, f, merged = flavor.dim, flavor.ffn_dim, flavor.dim * flavor.merge_unit
    norm = ("weight",) if flavor.gated_mlp else ("weight", "bias")
    shapes: dict[str, tuple[int, ...]] = {"patch_embed.weight": (d, flavor.patch_dim)}

    def linear(name: str, n_in: int, n_out: int) -> None:
        shapes[f"{name}.weight"] = (n_out, n_in)
        shapes[f"{name}.bias"] = (n_out,)

    for index in range(flavor.num_layers):
        prefix = f"blocks.{index}"
        for norm_name in ("attn_norm", "mlp_norm"):
            shapes.update({f"{prefix}.{norm_name}.{p}": (d,) for p in norm})
        linear(f"{prefix}.attn.qkv", d, 3 * d)
        linear(f"{prefix}.attn.out", d, d)
        linear(f"{prefix}.mlp.fc1", d, 2 * f if flavor.gated_mlp else f)
        linear(f"{prefix}.mlp.fc2", f, d)
    shapes.update({f"merger.norm.{p}": (d,) for p in norm})
    linear("merger.fc1", merged, merged)
    linear("merger.fc2", merged, flavor.out_dim)
    return shapes


def num_params(flavor: QwenViTFlavor) -> int:
    """Parameter count, computed from the shapes so listings need no torch."""
    return sum(math.prod(shape) for shape in parameter_shapes(flavor).values())


_QWEN2_VL = dict(family="qwen2-vl", dim=1280, ffn_dim=5120, num_heads=16, num_layers=32)
_QWEN25_VL = dict(family="qwen2.5-vl", dim=1280, ffn_dim=3420, num_heads=16, num_layers=32, window_size=112,
                  full_attention_blocks=(7, 15, 23, 31))

FLAVORS: dict[str, QwenViTFlavor] = {
    "qwen2-vl-vit-tiny": QwenViTFlavor(family="qwen2-vl", dim=32, ffn_dim=128, num_heads=2, num_layers=2,
                                       out_dim=48, patch_size=4),
    "qwen2.5-vl-vit-tiny": QwenViTFlavor(family="qwen2.5-vl", dim=32, ffn_dim=40, num_heads=2, num_layers=4,
                                         out_dim=48, patch_size=4, window_size=16, full_attention_blocks=(1, 3)),
    "qwen2-vl-2b-vit": QwenViTFlavor(out_dim=1536, **_QWEN2_VL),
    "qwen2-vl-7b-vit": QwenViTFlavor(out_dim=3584, **_QWEN2_VL),
    "qwen2.5-vl-3b-vit": QwenViTFlavor(out_dim=2048, **_QWEN25_VL),
    "qwen2.5-vl-7b-vit": QwenViTFlavor(out_dim=3584, **_QWEN25_VL),
}

#: The checkpoint each real flavor's values come from (its ``vision_config``); the Hugging Face ids are not
#: registered as aliases because they name the whole VLM, not the vision tower.
SOURCES: dict[str, str] = {
    "qwen2-vl-2b-vit": "Qwen/Qwen2-VL-2B-Instruct",
    "qwen2-vl-7b-vit": "Qwen/Qwen2-VL-7B-Instruct",
    "qwen2.5-vl-3b-vit": "Qwen/Qwen2.5-VL-3B-Instruct",
    "qwen2.5-vl-7b-vit": "Qwen/Qwen2.5-VL-7B-Instruct",
}


def describe(flavor: QwenViTFlavor) -> str:
    """One line for ``loongforge list``."""
    count = num_params(flavor)
    size = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"
    family = "Qwen2.5-VL" if flavor.family == "qwen2.5-vl" else "Qwen2-VL"
    parts = [f"{family} vision encoder + patch merger", f"{size} params", f"{flavor.num_layers} layers",
             f"d{flavor.dim}", f"{flavor.num_heads} heads", f"out {flavor.out_dim}"]
    if flavor.windowed:
        parts.append(f"{flavor.window_size}px windows, full attention in blocks {list(flavor.full_attention_blocks)}")
    return ", ".join(parts)
