"""Example third-party LoongForge model family: OLMo-2 (import name ``loongforge_example_family``)."""

__version__ = "0.2.0"
