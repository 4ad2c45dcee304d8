"""LoongForge diffusion models (import name ``loongforge_diffusion``)."""

__version__ = "0.4.0"
