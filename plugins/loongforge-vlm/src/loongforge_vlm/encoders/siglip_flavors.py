"""``SiglipFlavor``: the hyperparameters of one SigLIP vision tower, and the named flavors.

Torch-free, because the plugin's collector hook registers these objects and ``loongforge list`` must stay
instant (the model itself lives in :mod:`loongforge_vlm.encoders.siglip`, which re-exports these names).
The real size carries the ``vision_config`` of the published ``google/siglip-so400m-patch14-384`` checkpoint;
``siglip-tiny`` is a CPU size for parity tests and the synthetic-shapes quickstart (32x32 images, 4x4 patches).
Only the patch-token trunk is modelled: SigLIP's attention-pooling head is not, because a VLM feeds the
LLM the patch tokens, not one pooled vector. The ``anyres_*`` fields switch on LLaVA-OneVision's AnyRes tiling
(:mod:`loongforge_vlm.encoders.anyres`); they are the tower's because they say what images it sees, as InternViT's
tiling fields do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.models.listing import count_of_shapes, size_label

from loongforge_vlm.encoders.anyres import AnyResLayout, Pinpoints, grid_pinpoints
from loongforge_vlm.encoders.vit_sizes import ViTSizes


@dataclass(frozen=True)
class SiglipFlavor(ViTSizes):
    """One SigLIP vision tower: a pre-LN ViT with learned positions, GELU(tanh) MLPs and a final LayerNorm.

    ``image_size`` is the resolution the position table was trained for; other resolutions interpolate it.
    It need not be a multiple of ``patch_size``: like SigLIP's "valid" convolution, the last
    ``image_size % patch_size`` rows and columns are not seen (so400m: 384px -> 27x27 patches of 14px).
    """

    kind: ClassVar[str] = "siglip"

    #: The final LayerNorm on the output tokens. LLaVA-OneVision feeds its projector the last block's output
    #: without it (``vision_feature_layer: -1`` of transformers' hidden states), so its tower has none.
    post_norm: bool = True
    #: AnyRes tiling on, with every ``rows x cols`` grid of ``image_size`` tiles up to this many per side as the
    #: allowed resolutions (LLaVA-OneVision: 6); 0 is off (one ``image_size`` square per image).
    anyres_grid: int = 0
    #: AnyRes tiling on, with these ``[height, width]`` resolutions (multiples of ``image_size``) instead of a full
    #: grid: transformers' ``image_grid_pinpoints``. Set this or ``anyres_grid``, not both.
    anyres_pinpoints: Pinpoints = ()
    #: The token budget of a tiled image's high-resolution features, in tiles (``anyres_max_9``: 9); a feature map
    #: more than 1.1 times larger is shrunk (bilinearly) to it.
    anyres_max_tiles: int = 9

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.image_size < self.patch_size:
            raise ConfigError(f"siglip flavor: image_size ({self.image_size}) is smaller than patch_size "
                              f"({self.patch_size})")
        self._check_anyres()

    def _check_anyres(self) -> None:
        """Normalise the pinpoints to a tuple of pairs (YAML gives lists) and refuse what cannot tile."""
        try:
            pinpoints = tuple((int(h), int(w)) for h, w in self.anyres_pinpoints)
        except (TypeError, ValueError):
            raise ConfigError(f"siglip flavor: anyres_pinpoints must be [height, width] pairs, got "
                              f"{self.anyres_pinpoints!r}") from None
        object.__setattr__(self, "anyres_pinpoints", pinpoints)
        odd = [list(p) for p in pinpoints if min(p) < 1 or p[0] % self.image_size or p[1] % self.image_size]
        if odd:
            raise ConfigError(f"siglip flavor: anyres_pinpoints {odd} are not positive multiples of image_size "
                              f"{self.image_size}")
        if self.anyres_grid < 0 or self.anyres_max_tiles < 1:
            raise ConfigError(f"siglip flavor: need anyres_grid >= 0 and anyres_max_tiles >= 1, got "
                              f"{self.anyres_grid} and {self.anyres_max_tiles}")
        if pinpoints and self.anyres_grid:
            raise ConfigError("siglip flavor: set anyres_grid or anyres_pinpoints, not both (the grid is shorthand "
                              "for the pinpoints of every arrangement up to that size)")

    @property
    def anyres(self) -> bool:
        """Whether images are AnyRes-tiled."""
        return bool(self.anyres_grid or self.anyres_pinpoints)

    @property
    def pinpoints(self) -> Pinpoints:
        """The allowed ``(height, width)`` resolutions of AnyRes tiling (empty when it is off)."""
        return self.anyres_pinpoints or grid_pinpoints(self.anyres_grid, self.image_size)

    def anyres_layout(self, merge: int) -> AnyResLayout | None:
        """The AnyRes geometry behind a projector merging ``merge x merge`` patches (``None`` when it is off)."""
        if not self.anyres:
            return None
        return AnyResLayout(tile=self.image_size, patches=self.grid_size, side=self.grid_size // merge,
                            pinpoints=self.pinpoints, max_tiles=self.anyres_max_tiles)

    @property
    def num_positions(self) -> int:
        """Rows of the position table, one per whole patch (``grid_size ** 2``)."""
        return self.grid_size ** 2

    def to_hf_config(self) -> dict[str, Any]:
        """Keyword arguments of transformers' ``SiglipVisionConfig`` describing the same tower (no pooling head)."""
        return {"hidden_size": self.dim, "intermediate_size": self.ffn_dim, "num_attention_heads": self.num_heads,
                "num_hidden_layers": self.num_layers, "patch_size": self.patch_size, "image_size": self.image_size,
                "num_channels": self.in_channels, "layer_norm_eps": self.eps, "hidden_act": "gelu_pytorch_tanh",
                "vision_use_head": False}

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> SiglipFlavor:
        """The flavor of a ``SiglipVisionConfig`` dict (a checkpoint's ``config.json`` or its ``vision_config``).

        Missing keys take transformers' defaults, which is what the published configs rely on. An activation
        other than GELU(tanh) is an error, because the blocks hard-wire it.
        """
        act = config.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ConfigError(f"siglip flavor: hidden_act {act!r} is not supported (only 'gelu_pytorch_tanh')")
        return cls(dim=config.get("hidden_size", 768), ffn_dim=config.get("intermediate_size", 3072),
                   num_heads=config.get("num_attention_heads", 12), num_layers=config.get("num_hidden_layers", 12),
                   patch_size=config.get("patch_size", 16), image_size=config.get("image_size", 224),
                   in_channels=config.get("num_channels", 3), eps=config.get("layer_norm_eps", 1e-6))


def parameter_shapes(flavor: SiglipFlavor) -> dict[str, tuple[int, ...]]:
    """Every parameter of :class:`~loongforge_vlm.encoders.siglip.SiglipVisionEncoder` and its shape (torch-free).

    The state-dict adapter checks tensors against this table, and :func:`num_params` sums it.
    """
    d = flavor.dim
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name: str, n_in: int, n_out: int) -> None:
        shapes[f"{name}.weight"] = (n_out, n_in)
        shapes[f"{name}.bias"] = (n_out,)

    def norm(name: str) -> None:
        shapes[f"{name}.weight"] = (d,)
        shapes[f"{name}.bias"] = (d,)

    linear("patch_embed", flavor.patch_dim, d)
    shapes["pos_embed"] = (flavor.num_positions, d)
    for index in range(flavor.num_layers):
        prefix = f"blocks.{index}"
        norm(f"{prefix}.attn_norm")
        linear(f"{prefix}.attn.qkv", d, 3 * d)
        linear(f"{prefix}.attn.out", d, d)
        norm(f"{prefix}.mlp_norm")
        linear(f"{prefix}.mlp.fc1", d, flavor.ffn_dim)
        linear(f"{prefix}.mlp.fc2", flavor.ffn_dim, d)
    if flavor.post_norm:
        norm("post_norm")
    return shapes


def num_params(flavor: SiglipFlavor) -> int:
    """Parameter count, computed from the shapes so listings need no torch."""
    return count_of_shapes(parameter_shapes(flavor))


SIGLIP_FLAVORS: dict[str, SiglipFlavor] = {
    "siglip-tiny": SiglipFlavor(dim=32, ffn_dim=64, num_heads=2, num_layers=2, patch_size=4, image_size=32),
    "siglip-so400m-patch14-384": SiglipFlavor(dim=1152, ffn_dim=4304, num_heads=16, num_layers=27, patch_size=14,
                                              image_size=384),
}

#: The checkpoint each real flavor's values come from (``vision_config`` of its ``config.json``).
SOURCES: dict[str, str] = {"siglip-so400m-patch14-384": "google/siglip-so400m-patch14-384"}


def describe(flavor: SiglipFlavor) -> str:
    """One line for ``loongforge list``."""
    count = num_params(flavor)
    size = size_label(count)
    tiling = f", AnyRes up to {max(map(max, flavor.pinpoints))}px" if flavor.anyres else ""
    return (f"SigLIP vision encoder, {size} params, {flavor.num_layers} layers, d{flavor.dim}, "
            f"{flavor.num_heads} heads, patch {flavor.patch_size}, {flavor.image_size}px{tiling}")
