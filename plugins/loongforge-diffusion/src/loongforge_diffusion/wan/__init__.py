"""Wan 2.1 / 2.2 video diffusion transformer.

Kept import-light on purpose: :mod:`loongforge_diffusion.wan.flavors` is read by the plugin's collector hook,
which must not import torch; the torch modules live in sibling modules imported only when a model is built.
"""
