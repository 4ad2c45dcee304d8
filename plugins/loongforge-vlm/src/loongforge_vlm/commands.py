"""What the ``vlm`` plugin adds to the ``loongforge`` command line: Qwen2-VL / Qwen2.5-VL conversion both ways
(``loongforge convert``) and VQA evaluation of a VLM checkpoint (``loongforge eval``).

Torch-free: the claims read ``config.json`` or a checkpoint's saved config; the converters and the evaluator are
registered by import path and load when they run.
"""

from __future__ import annotations

from loongforge.claims import checkpoint_model, hf_config_names
from loongforge.commands import CommandRegistry


def claims_hf_vlm(source: str, *, trust_code: bool) -> bool:
    """A transformers directory of a vision-language architecture :mod:`loongforge_vlm.model.hf_interop` reads."""
    from loongforge_vlm.model.hf_interop import ARCHITECTURES

    arch, model_type = hf_config_names(source)
    if arch is not None:
        return arch in ARCHITECTURES
    return model_type in {row[1] for row in ARCHITECTURES.values()}


def claims_vlm_checkpoint(source: str, *, trust_code: bool) -> bool:
    """A LoongForge checkpoint of a composed vision-language model."""
    from loongforge_vlm.model.flavors import VLMFlavor

    return isinstance(checkpoint_model(source, trust_code=trust_code), VLMFlavor)


def register_commands(commands: CommandRegistry) -> None:
    commands.add_handler("convert hf-to-mcore", "hf-vlm", claims=claims_hf_vlm,
                         accepts="a transformers Qwen2-VL / Qwen2.5-VL directory (config.json architectures "
                                 "Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration)",
                         configure="loongforge_vlm.convert:configure_hf_to_loongforge",
                         run="loongforge_vlm.convert:run_hf_to_loongforge")
    commands.add_handler("convert mcore-to-hf", "vlm-checkpoint", claims=claims_vlm_checkpoint,
                         accepts="a LoongForge checkpoint of a Qwen2-VL / Qwen2.5-VL model",
                         configure="loongforge_vlm.convert:configure_loongforge_to_hf",
                         run="loongforge_vlm.convert:run_loongforge_to_hf")
    commands.add_handler("eval", "vlm-vqa", claims=claims_vlm_checkpoint,
                         accepts="a LoongForge checkpoint of a vision-language model (held-out VQA accuracy)",
                         configure="loongforge_vlm.evaluate:configure", run="loongforge_vlm.evaluate:run")
