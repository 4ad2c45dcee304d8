"""Example third-party LoongForge model family (import name ``loongforge_example_family``)."""

__version__ = "0.1.0"
