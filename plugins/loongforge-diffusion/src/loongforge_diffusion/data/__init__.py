"""Datasets of the diffusion plugin."""
