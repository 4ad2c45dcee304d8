"""LoongForge embodied VLA policies (import name ``loongforge_embodied``)."""

__version__ = "0.8.0"
