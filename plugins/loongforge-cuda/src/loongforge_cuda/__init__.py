"""LoongForge NVIDIA GPU backend (import name ``loongforge_cuda``)."""

__version__ = "0.6.0"
