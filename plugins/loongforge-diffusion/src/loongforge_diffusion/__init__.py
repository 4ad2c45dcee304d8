"""LoongForge diffusion models (import name ``loongforge_diffusion``)."""

__version__ = "0.5.0"
