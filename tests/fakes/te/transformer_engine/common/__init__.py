"""FAKE transformer_engine.common -- NOT NVIDIA's package; see tests/fakes/README.md."""
