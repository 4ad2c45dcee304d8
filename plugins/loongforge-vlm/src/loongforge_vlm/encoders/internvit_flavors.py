"""``InternViTFlavor``: the hyperparameters of one InternViT vision tower (InternVL's encoder), and the named flavors.

Torch-free, because the plugin registers these objects and ``loongforge list`` must stay instant (the model lives in
:mod:`loongforge_vlm.encoders.internvit`). InternViT is a pre-LN ViT with a CLS token, learned absolute positions,
per-channel layer scale on both residual branches and, in the 6B tower, RMSNorm and QK-norm; the 300M tower (the
encoder of InternVL2.5/3 1B-14B) uses LayerNorm without QK-norm. Images reach it as square tiles of ``image_size``
(:mod:`loongforge_vlm.data.tiling`): ``min_tiles``..``max_tiles`` tiles on the grid closest to the image's aspect
ratio, plus a thumbnail of the whole image when there is more than one (InternVL's dynamic tiling). The tiling
settings live here because they decide how many LLM tokens an image becomes, so a flavor fixes both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.models.listing import count_of_shapes, size_label

from loongforge_vlm.encoders.vit_sizes import ViTSizes

#: Normalisation layers the tower can use (transformers' ``norm_type``).
NORMS = ("layer_norm", "rms_norm")


@dataclass(frozen=True)
class InternViTFlavor(ViTSizes):
    """One InternViT tower. ``norm`` is ``layer_norm`` or ``rms_norm`` (block norms), ``qk_norm`` an RMSNorm over the
    whole query and key projections, ``qkv_bias`` biases on them. Tiles must be ``image_size`` square (the position
    table is not interpolated: InternVL never feeds another size); ``max_tiles=1`` turns tiling off (one resized
    square per image)."""

    kind: ClassVar[str] = "internvit"
    POSITIVE: ClassVar[tuple[str, ...]] = (*ViTSizes.POSITIVE, "min_tiles", "max_tiles")

    norm: str = "layer_norm"
    qk_norm: bool = False
    qkv_bias: bool = True
    #: InternVL's processor defaults (``crop_to_patches`` with ``min_patches=1, max_patches=12``, thumbnail on).
    min_tiles: int = 1
    max_tiles: int = 12
    thumbnail: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.image_size % self.patch_size:
            raise ConfigError(f"internvit flavor: image_size ({self.image_size}) is not a multiple of patch_size "
                              f"({self.patch_size})")
        if self.norm not in NORMS:
            raise ConfigError(f"internvit flavor: norm must be one of {', '.join(NORMS)}, got {self.norm!r}")
        if self.min_tiles > self.max_tiles:
            raise ConfigError(f"internvit flavor: min_tiles ({self.min_tiles}) exceeds max_tiles ({self.max_tiles})")

    @property
    def num_positions(self) -> int:
        """Rows of the position table: the CLS token's, then one per patch of a tile."""
        return self.grid_size ** 2 + 1

    def to_hf_config(self) -> dict[str, Any]:
        """Keyword arguments of transformers' ``InternVLVisionConfig`` for the same tower (the tiling settings belong
        to the image processor, not to this config)."""
        return {"hidden_size": self.dim, "intermediate_size": self.ffn_dim, "num_attention_heads": self.num_heads,
                "num_hidden_layers": self.num_layers, "patch_size": self.patch_size, "image_size": self.image_size,
                "num_channels": self.in_channels, "layer_norm_eps": self.eps, "norm_type": self.norm,
                "use_qk_norm": self.qk_norm, "attention_bias": self.qkv_bias, "hidden_act": "gelu",
                "use_mean_pooling": True, "use_mask_token": False, "use_absolute_position_embeddings": True}

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], where: str = "vision_config") -> InternViTFlavor:
        """The flavor of an ``InternVLVisionConfig`` mapping (missing keys take transformers' defaults). A switch the
        tower does not implement is a one-line error naming the key."""
        for key, needed in (("hidden_act", "gelu"), ("use_mean_pooling", True), ("use_mask_token", False),
                            ("use_absolute_position_embeddings", True)):
            if config.get(key, needed) != needed:
                raise ConfigError(f"{where}.{key}={config[key]!r} is not supported (needs {needed!r})")
        sizes = {}
        for key, default in (("image_size", 448), ("patch_size", 14)):
            value = config.get(key, default)
            value = value if isinstance(value, int) else list(value)
            if isinstance(value, list) and len(set(value)) != 1:
                raise ConfigError(f"{where}.{key}={value!r} is not supported (needs a square size)")
            sizes[key] = value if isinstance(value, int) else value[0]
        return cls(dim=config.get("hidden_size", 1024), ffn_dim=config.get("intermediate_size", 4096),
                   num_heads=config.get("num_attention_heads", 16), num_layers=config.get("num_hidden_layers", 24),
                   in_channels=config.get("num_channels", 3), eps=config.get("layer_norm_eps", 1e-6),
                   norm=config.get("norm_type", "layer_norm"), qk_norm=config.get("use_qk_norm", False),
                   qkv_bias=config.get("attention_bias", False), **sizes)


def parameter_shapes(flavor: InternViTFlavor) -> dict[str, tuple[int, ...]]:
    """Every parameter of :class:`~loongforge_vlm.encoders.internvit.InternViT` and its shape (torch-free)."""
    d = flavor.dim
    shapes: dict[str, tuple[int, ...]] = {"cls_token": (1, 1, d), "pos_embed": (1, flavor.num_positions, d),
                                          "patch_embed.weight": (d, flavor.patch_dim), "patch_embed.bias": (d,)}
    norm_params = ("weight", "bias") if flavor.norm == "layer_norm" else ("weight",)
    for index in range(flavor.num_layers):
        block = f"blocks.{index}"
        for norm in ("attn_norm", "mlp_norm"):
            shapes.update({f"{block}.{norm}.{p}": (d,) for p in norm_params})
        shapes[f"{block}.attn.qkv.weight"] = (3 * d, d)
        if flavor.qkv_bias:
            shapes[f"{block}.attn.qkv.bias"] = (3 * d,)
        if flavor.qk_norm:
            shapes[f"{block}.attn.q_norm.weight"] = (d,)
            shapes[f"{block}.attn.k_norm.weight"] = (d,)
        shapes.update({f"{block}.attn.out.weight": (d, d), f"{block}.attn.out.bias": (d,),
                       f"{block}.mlp.fc1.weight": (flavor.ffn_dim, d), f"{block}.mlp.fc1.bias": (flavor.ffn_dim,),
                       f"{block}.mlp.fc2.weight": (d, flavor.ffn_dim), f"{block}.mlp.fc2.bias": (d,),
                       f"{block}.attn_scale": (d,), f"{block}.mlp_scale": (d,)})
    return shapes


def num_params(flavor: InternViTFlavor) -> int:
    """Parameter count, computed from the shapes so listings need no torch."""
    return count_of_shapes(parameter_shapes(flavor))


INTERNVIT_FLAVORS: dict[str, InternViTFlavor] = {
    # 16px tiles of 4px patches: a 4x4 grid, 2x2 tokens per tile after InternVL's pixel shuffle; head_dim 16.
    "internvit-tiny": InternViTFlavor(dim=32, ffn_dim=64, num_heads=2, num_layers=2, patch_size=4, image_size=16),
    # vision_config of the published OpenGVLab/InternVL3-1B-hf (= InternViT-300M-448px-V2_5, the tower of
    # InternVL3-1B/2B/8B): 24 layers, d1024, 16 heads, 448px tiles of 14px patches, qkv bias, LayerNorm.
    "internvit-300m": InternViTFlavor(dim=1024, ffn_dim=4096, num_heads=16, num_layers=24, patch_size=14,
                                      image_size=448),
}

#: The checkpoint each real flavor's values come from.
SOURCES: dict[str, str] = {"internvit-300m": "OpenGVLab/InternViT-300M-448px-V2_5"}


def describe(flavor: InternViTFlavor) -> str:
    """One line for ``loongforge list``."""
    count = num_params(flavor)
    size = size_label(count)
    return (f"InternViT vision encoder, {size} params, {flavor.num_layers} layers, d{flavor.dim}, "
            f"{flavor.num_heads} heads, {flavor.image_size}px tiles of {flavor.patch_size}px patches, "
            f"{flavor.min_tiles}-{flavor.max_tiles} tiles{' + thumbnail' if flavor.thumbnail else ''}")
