"""``SiglipFlavor``: the hyperparameters of one SigLIP vision tower, and the named flavors.

Torch-free, because the plugin's collector hook registers these objects and ``loongforge list`` must stay
instant (the model itself lives in :mod:`loongforge_vlm.encoders.siglip`, which re-exports these names).
The real size carries the ``vision_config`` of the published ``google/siglip-so400m-patch14-384`` checkpoint;
``siglip-tiny`` is a CPU size for parity tests and the synthetic-shapes quickstart (32x32 images, 4x4 patches).
Only the patch-token trunk is modelled: SigLIP's attention-pooling head is not, because a VLM feeds the
LLM the patch tokens, not one pooled vector.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.models.listing import count_of_shapes, size_label

from loongforge_vlm.encoders.vit_sizes import ViTSizes


@dataclass(frozen=True)
class SiglipFlavor(ViTSizes):
    """One SigLIP vision tower: a pre-LN ViT with learned positions, GELU(tanh) MLPs and a final LayerNorm.

    ``image_size`` is the resolution the position table was trained for; other resolutions interpolate it.
    It need not be a multiple of ``patch_size``: like SigLIP's "valid" convolution, the last
    ``image_size % patch_size`` rows and columns are not seen (so400m: 384px -> 27x27 patches of 14px).
    """

    kind: ClassVar[str] = "siglip"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.image_size < self.patch_size:
            raise ConfigError(f"siglip flavor: image_size ({self.image_size}) is smaller than patch_size "
                              f"({self.patch_size})")

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
    return (f"SigLIP vision encoder, {size} params, {flavor.num_layers} layers, d{flavor.dim}, "
            f"{flavor.num_heads} heads, patch {flavor.patch_size}, {flavor.image_size}px")
