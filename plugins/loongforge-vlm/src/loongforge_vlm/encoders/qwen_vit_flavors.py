"""``QwenViTFlavor``: the hyperparameters of one Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision encoder, and the named
flavors.

Torch-free, because the plugin's collector hook registers these objects and ``loongforge list`` must stay
instant. The real sizes carry the ``vision_config`` of the published Qwen checkpoints (Qwen2-VL-2B/7B-Instruct,
Qwen2.5-VL-3B/7B-Instruct, Qwen3-VL-2B/8B/30B-A3B/235B-A22B-Instruct); the ``*-tiny`` flavors are CPU sizes for
parity tests. The families differ in the block (LayerNorm + QuickGELU MLP, RMSNorm + SwiGLU MLP, LayerNorm +
tanh-GELU MLP), the merger's norm, Qwen2.5-VL's window attention (every block not listed in
``full_attention_blocks`` attends only inside ``window_size`` pixel windows), and Qwen3-VL's additions: a bias on
the patch embedding, a learned ``sqrt(num_position_embeddings)``-square grid of absolute positions resampled
bilinearly to each image, and DeepStack -- the outputs of the ``deepstack_layers`` blocks go through mergers of
their own and are added to the language model's first hidden states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from loongforge.errors import ConfigError
from loongforge.models.flavor import replace_fields
from loongforge.models.listing import count_of_shapes, size_label

#: Encoder families: Qwen2-VL's ViT, Qwen2.5-VL's windowed one and Qwen3-VL's DeepStack one.
FAMILIES: tuple[str, ...] = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")
#: The MLP activation of each family (transformers' ``hidden_act``; Qwen2.5-VL's gates with it).
ACTIVATIONS: dict[str, str] = {"qwen2-vl": "quick_gelu", "qwen2.5-vl": "silu", "qwen3-vl": "gelu_pytorch_tanh"}


@dataclass(frozen=True)
class QwenViTFlavor:
    """One Qwen vision tower, including the patch merger that projects merged patches to the LLM width.

    ``ffn_dim`` is the MLP hidden size (Qwen2-VL: ``mlp_ratio * dim``; Qwen2.5-VL: ``intermediate_size``).
    ``window_size`` (pixels) and ``full_attention_blocks`` only exist for Qwen2.5-VL;
    ``num_position_embeddings`` (a square number: the learned position grid) and ``deepstack_layers`` (blocks whose
    outputs feed the DeepStack mergers, in the order the language model's layers receive them) for Qwen3-VL.
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
    num_position_embeddings: int | None = None
    deepstack_layers: tuple[int, ...] = ()
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
        self._check_qwen3()

    def _check_qwen3(self) -> None:
        object.__setattr__(self, "deepstack_layers", tuple(self.deepstack_layers))  # YAML lists stay hashable
        if self.family != "qwen3-vl":
            if self.num_position_embeddings is not None or self.deepstack_layers:
                raise ConfigError("qwen vit flavor: num_position_embeddings and deepstack_layers are Qwen3-VL only")
            return
        side = math.isqrt(self.num_position_embeddings or 0)
        if side < 2 or side * side != self.num_position_embeddings:
            raise ConfigError(f"qwen vit flavor: qwen3-vl needs num_position_embeddings, a square >= 4 (the learned "
                              f"position grid), got {self.num_position_embeddings}")
        outside = [i for i in self.deepstack_layers if not 0 <= i < self.num_layers]
        if outside or len(set(self.deepstack_layers)) != len(self.deepstack_layers):
            raise ConfigError(f"qwen vit flavor: deepstack_layers {list(self.deepstack_layers)} must be distinct "
                              f"blocks in 0..{self.num_layers - 1}")

    @property
    def timestamped_videos(self) -> bool:
        """Whether the text marks each video frame group with its time (Qwen3-VL: ``<0.5 seconds>`` before every
        group's vision tokens) instead of spacing the groups' temporal positions by their time."""
        return self.family == "qwen3-vl"

    @property
    def pixel_normalization(self) -> str:
        """The per-channel statistics its processor normalises with (a key of
        :data:`loongforge_vlm.data.processor.NORMALIZATIONS`): CLIP's for Qwen2-VL and Qwen2.5-VL, mean = std = 0.5
        for Qwen3-VL (its published ``preprocessor_config.json`` and transformers' video processor)."""
        return "siglip" if self.family == "qwen3-vl" else "clip"

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
        """Qwen2.5-VL blocks use a SwiGLU MLP and RMSNorm; Qwen2-VL and Qwen3-VL a plain MLP and LayerNorm."""
        return self.family == "qwen2.5-vl"

    @property
    def activation(self) -> str:
        """The MLP activation, by transformers' name."""
        return ACTIVATIONS[self.family]

    @property
    def learned_positions(self) -> bool:
        """Qwen3-VL adds a learned absolute position (and a patch-embedding bias) to each patch."""
        return self.family == "qwen3-vl"

    @property
    def position_grid_side(self) -> int:
        """Side of the square learned position grid (Qwen3-VL)."""
        return math.isqrt(self.num_position_embeddings or 0)

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
    if flavor.learned_positions:
        shapes["patch_embed.bias"] = (d,)
        shapes["pos_embed.weight"] = (flavor.num_position_embeddings, d)

    def linear(name: str, n_in: int, n_out: int) -> None:
        shapes[f"{name}.weight"] = (n_out, n_in)
        shapes[f"{name}.bias"] = (n_out,)

    def merger(name: str, norm_width: int) -> None:
        shapes.update({f"{name}.norm.{p}": (norm_width,) for p in norm})
        linear(f"{name}.fc1", merged, merged)
        linear(f"{name}.fc2", merged, flavor.out_dim)

    for index in range(flavor.num_layers):
        prefix = f"blocks.{index}"
        for norm_name in ("attn_norm", "mlp_norm"):
            shapes.update({f"{prefix}.{norm_name}.{p}": (d,) for p in norm})
        linear(f"{prefix}.attn.qkv", d, 3 * d)
        linear(f"{prefix}.attn.out", d, d)
        linear(f"{prefix}.mlp.fc1", d, 2 * f if flavor.gated_mlp else f)
        linear(f"{prefix}.mlp.fc2", f, d)
    merger("merger", d)
    for level in range(len(flavor.deepstack_layers)):
        merger(f"deepstack_mergers.{level}", merged)  # these normalise the concatenated patches
    return shapes


def num_params(flavor: QwenViTFlavor) -> int:
    """Parameter count, computed from the shapes so listings need no torch."""
    return count_of_shapes(parameter_shapes(flavor))


_QWEN2_VL = dict(family="qwen2-vl", dim=1280, ffn_dim=5120, num_heads=16, num_layers=32)
_QWEN25_VL = dict(family="qwen2.5-vl", dim=1280, ffn_dim=3420, num_heads=16, num_layers=32, window_size=112,
                  full_attention_blocks=(7, 15, 23, 31))
# The published Qwen3-VL vision_config values: 16px patches, a 48x48 learned position grid, tanh-GELU MLPs.
_QWEN3_VL = dict(family="qwen3-vl", patch_size=16, num_position_embeddings=2304)
_QWEN3_VL_SMALL = dict(dim=1024, ffn_dim=4096, num_heads=16, num_layers=24, deepstack_layers=(5, 11, 17), **_QWEN3_VL)
_QWEN3_VL_LARGE = dict(dim=1152, ffn_dim=4304, num_heads=16, num_layers=27, deepstack_layers=(8, 16, 24), **_QWEN3_VL)

FLAVORS: dict[str, QwenViTFlavor] = {
    "qwen2-vl-vit-tiny": QwenViTFlavor(family="qwen2-vl", dim=32, ffn_dim=128, num_heads=2, num_layers=2,
                                       out_dim=48, patch_size=4),
    "qwen2.5-vl-vit-tiny": QwenViTFlavor(family="qwen2.5-vl", dim=32, ffn_dim=40, num_heads=2, num_layers=4,
                                         out_dim=48, patch_size=4, window_size=16, full_attention_blocks=(1, 3)),
    # 4 heads of 8 channels; a 4x4 position grid resampled to 6x8 and 4x4 patch grids; DeepStack from blocks 0, 2.
    "qwen3-vl-vit-tiny": QwenViTFlavor(family="qwen3-vl", dim=32, ffn_dim=40, num_heads=4, num_layers=3,
                                       out_dim=48, patch_size=4, num_position_embeddings=16,
                                       deepstack_layers=(0, 2)),
    "qwen2-vl-2b-vit": QwenViTFlavor(out_dim=1536, **_QWEN2_VL),
    "qwen2-vl-7b-vit": QwenViTFlavor(out_dim=3584, **_QWEN2_VL),
    "qwen2.5-vl-3b-vit": QwenViTFlavor(out_dim=2048, **_QWEN25_VL),
    "qwen2.5-vl-7b-vit": QwenViTFlavor(out_dim=3584, **_QWEN25_VL),
    "qwen3-vl-2b-vit": QwenViTFlavor(out_dim=2048, **_QWEN3_VL_SMALL),
    "qwen3-vl-8b-vit": QwenViTFlavor(out_dim=4096, **_QWEN3_VL_LARGE),
    "qwen3-vl-30b-a3b-vit": QwenViTFlavor(out_dim=2048, **_QWEN3_VL_LARGE),
    "qwen3-vl-235b-a22b-vit": QwenViTFlavor(out_dim=4096, **_QWEN3_VL_LARGE),
}

#: The checkpoint each real flavor's values come from (its ``vision_config``); the Hugging Face ids are not
#: registered as aliases because they name the whole VLM, not the vision tower.
SOURCES: dict[str, str] = {
    "qwen2-vl-2b-vit": "Qwen/Qwen2-VL-2B-Instruct",
    "qwen2-vl-7b-vit": "Qwen/Qwen2-VL-7B-Instruct",
    "qwen2.5-vl-3b-vit": "Qwen/Qwen2.5-VL-3B-Instruct",
    "qwen2.5-vl-7b-vit": "Qwen/Qwen2.5-VL-7B-Instruct",
    "qwen3-vl-2b-vit": "Qwen/Qwen3-VL-2B-Instruct",
    "qwen3-vl-8b-vit": "Qwen/Qwen3-VL-8B-Instruct",
    "qwen3-vl-30b-a3b-vit": "Qwen/Qwen3-VL-30B-A3B-Instruct",
    "qwen3-vl-235b-a22b-vit": "Qwen/Qwen3-VL-235B-A22B-Instruct",
}

#: How ``loongforge list`` names each family.
TITLES: dict[str, str] = {"qwen2-vl": "Qwen2-VL", "qwen2.5-vl": "Qwen2.5-VL", "qwen3-vl": "Qwen3-VL"}


def describe(flavor: QwenViTFlavor) -> str:
    """One line for ``loongforge list``."""
    count = num_params(flavor)
    size = size_label(count)
    parts = [f"{TITLES[flavor.family]} vision encoder + patch merger", f"{size} params", f"{flavor.num_layers} layers",
             f"d{flavor.dim}", f"{flavor.num_heads} heads", f"out {flavor.out_dim}"]
    if flavor.windowed:
        parts.append(f"{flavor.window_size}px windows, full attention in blocks {list(flavor.full_attention_blocks)}")
    if flavor.deepstack_layers:
        parts.append(f"DeepStack from blocks {list(flavor.deepstack_layers)}")
    return ", ".join(parts)
