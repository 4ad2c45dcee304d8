"""LoongForge Kunlunxin XPU backend (import name ``loongforge_xpu``)."""

__version__ = "0.5.0"
