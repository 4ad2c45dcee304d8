"""FAKE transformer_engine -- NOT NVIDIA's package; see tests/fakes/README.md."""
