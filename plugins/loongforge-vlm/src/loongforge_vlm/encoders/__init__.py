"""Vision encoders. Torch-free: the torch modules live in the submodules (``qwen_vit``), so that registering
flavors does not import torch."""

from loongforge_vlm.encoders.qwen_vit_flavors import QwenViTFlavor
from loongforge_vlm.encoders.siglip_flavors import SiglipFlavor

__all__ = ["QwenViTFlavor", "SiglipFlavor"]
