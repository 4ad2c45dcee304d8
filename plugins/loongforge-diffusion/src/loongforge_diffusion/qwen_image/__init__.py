"""Qwen-Image: the 20B MMDiT text-to-image transformer (double-stream blocks with joint attention).

Kept import-light on purpose: :mod:`loongforge_diffusion.qwen_image.flavors` is read by the plugin's collector
hook, which must not import torch; the torch modules live in sibling modules imported only when a model is built.
"""
