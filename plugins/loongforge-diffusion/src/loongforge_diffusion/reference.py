"""diffusers' own transformer as the reference implementation of the DiTs (``WanFlavor`` / ``QwenImageFlavor``
``.reference_implementation()``): ``loongforge diff CHECKPOINT DIFFUSERS_DIR --reference B`` runs a diffusers
transformer folder (what ``convert mcore-to-hf`` writes, or a published one) through the checkpoint's own task loss
and names the first module where our DiT computes differently.

diffusers' model is driven by the task's ``validation_loss`` -- the same noise, timesteps and conditioning drawn
from the same seeded generators -- through :class:`_CalledAsOurs`, which takes our DiT's call and returns
diffusers' prediction. Module pairs and parameter names come from the conversion's own name maps
(:mod:`loongforge_diffusion.qwen_image.diffusers_adapter`, :mod:`loongforge_diffusion.wan.diffusers_adapter`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loongforge.models.family import ModulePair, module_pairs_from_parameters


class _CalledAsOurs(torch.nn.Module):
    """diffusers' transformer called the way our DiT is (positional inputs, the prediction returned)."""

    def __init__(self, model: torch.nn.Module, flavor: Any) -> None:
        super().__init__()
        self.model, self.flavor = model, flavor

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.model(*args, **kwargs, return_dict=False)[0]


@dataclass(frozen=True)
class DiffusersTransformer:
    """diffusers' ``QwenImageTransformer2DModel`` / ``WanTransformer3DModel`` of one flavor
    (:class:`~loongforge.models.family.ReferenceImplementation`)."""

    flavor: Any
    library: str = "diffusers"

    def _qwen(self) -> bool:
        from loongforge_diffusion.qwen_image.flavors import QwenImageFlavor

        return isinstance(self.flavor, QwenImageFlavor)

    def load(self, path: Path) -> Any:
        """The transformer folder in fp32, in eval mode (the task's validation loss is computed in it)."""
        import diffusers

        name = "QwenImageTransformer2DModel" if self._qwen() else "WanTransformer3DModel"
        return getattr(diffusers, name).from_pretrained(str(path), torch_dtype=torch.float32).eval()

    def avoided_tokens(self, path: Path) -> tuple[int, ...]:
        return ()  # a DiT reads no token ids

    def loss(self, model: Any, batch: Mapping[str, Any]) -> Any:
        return batch["task"].validation_loss(_CalledAsOurs(model, self.flavor), batch["batch"], batch["generators"])

    def module_pairs(self) -> tuple[ModulePair, ...]:
        """Every module of ours that is one diffusers module renamed (the fused QKV projections pair nothing);
        a Wan block is also diffusers' block (a Qwen-Image block returns its two streams in the other order)."""
        pairs = module_pairs_from_parameters(self._name_map())
        if self._qwen():
            return pairs
        return (*pairs, *(ModulePair(f"blocks.{i}", f"blocks.{i}") for i in range(self.flavor.num_layers)))

    def parameters(self, state: Mapping[str, Any]) -> dict[str, Any]:
        from loongforge_diffusion.qwen_image import diffusers_adapter as qwen
        from loongforge_diffusion.wan import diffusers_adapter as wan

        return qwen.to_diffusers(state, self.flavor) if self._qwen() else wan.to_diffusers(state)

    def _name_map(self) -> dict[str, tuple[str, ...]]:
        from loongforge_diffusion.qwen_image import diffusers_adapter as qwen
        from loongforge_diffusion.wan import diffusers_adapter as wan

        return qwen.name_map(self.flavor) if self._qwen() else wan.name_map(self.flavor)
