"""Projectors from vision features to the language model's embedding width."""

from loongforge_vlm.projectors.mlp import MlpProjector
from loongforge_vlm.projectors.patch_merger import PatchMerger

__all__ = ["MlpProjector", "PatchMerger"]
