"""LoongForge load-balancing optimizations (import name ``loongforge_balance``)."""

__version__ = "0.6.0"
