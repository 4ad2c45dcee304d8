"""LoongForge diffusion models (import name ``loongforge_diffusion``)."""

__version__ = "0.7.0"
