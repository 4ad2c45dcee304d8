"""Example third-party LoongForge device backend (import name ``loongforge_example_device``)."""

__version__ = "0.1.0"
