"""LoongForge diffusion models (import name ``loongforge_diffusion``)."""

__version__ = "0.8.0"
