"""LoongForge vision-language models (import name ``loongforge_vlm``)."""

__version__ = "0.7.0"
