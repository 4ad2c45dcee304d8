"""What the ``vlm`` plugin adds to the ``loongforge`` command line: Qwen2-VL / Qwen2.5-VL / Qwen3-VL conversion
both ways (``loongforge convert``), VQA evaluation of a VLM checkpoint (``loongforge eval``), the synthetic shapes
set (``loongforge make-data shapes``) and preference pairs on shapes images (``loongforge make-data shapes-pairs``).

Torch-free: the claims read ``config.json`` or a checkpoint's saved config; the converters, the evaluator and the
generator are registered by import path and load when they run. The generator's options are set up here, because
every generator's are whenever ``make-data`` is parsed, and the drawing module imports numpy and Pillow.
"""

from __future__ import annotations

import argparse

from loongforge.claims import checkpoint_model, hf_config_names
from loongforge.commands import CommandRegistry


def claims_hf_vlm(source: str, *, trust_code: bool) -> bool:
    """A transformers directory of a vision-language architecture :mod:`loongforge_vlm.model.hf_interop` reads."""
    from loongforge_vlm.model import internvl_interop
    from loongforge_vlm.model.hf_interop import ARCHITECTURES

    arch, model_type = hf_config_names(source)
    if arch is not None:
        return arch in ARCHITECTURES or arch == internvl_interop.ARCHITECTURE
    return model_type in {row[1] for row in ARCHITECTURES.values()} | {internvl_interop.MODEL_TYPE}


def claims_vlm_checkpoint(source: str, *, trust_code: bool) -> bool:
    """A LoongForge checkpoint of a composed vision-language model."""
    from loongforge_vlm.model.flavors import VLMFlavor

    return isinstance(checkpoint_model(source, trust_code=trust_code), VLMFlavor)


def configure_shapes(parser: argparse.ArgumentParser) -> None:
    """The options of ``loongforge make-data shapes`` (run by :func:`loongforge_vlm.data.shapes.make_data`)."""
    parser.add_argument("out_dir", help="directory to write (or, with --validate, to check)")
    parser.add_argument("--count", type=int, default=1000, help="samples over both splits (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated shapes (default 0)")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels, even, >= 16 (default 32)")
    parser.add_argument("--heldout-fraction", type=float, default=0.1, help="share of held-out samples (0.1)")
    parser.add_argument("--format", default="jsonl", metavar="{jsonl,wds}",
                        help="jsonl + PNG files (default) or WebDataset tar shards (wds)")
    parser.add_argument("--shard-size", type=int, default=1000, help="samples per shard with --format wds (1000)")
    parser.add_argument("--validate", action="store_true", help="only check an existing set; exit 1 on problems")


def register_commands(commands: CommandRegistry) -> None:
    commands.add_handler("convert hf-to-mcore", "hf-vlm", claims=claims_hf_vlm,
                         accepts="a transformers Qwen2-VL / Qwen2.5-VL / Qwen3-VL / InternVL directory (config.json "
                                 "architectures Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration "
                                 "/ Qwen3VLForConditionalGeneration / InternVLForConditionalGeneration)",
                         configure="loongforge_vlm.convert:configure_hf_to_loongforge",
                         run="loongforge_vlm.convert:run_hf_to_loongforge")
    commands.add_handler("convert mcore-to-hf", "vlm-checkpoint", claims=claims_vlm_checkpoint,
                         accepts="a LoongForge checkpoint of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / InternVL model",
                         configure="loongforge_vlm.convert:configure_loongforge_to_hf",
                         run="loongforge_vlm.convert:run_loongforge_to_hf")
    commands.add_handler("eval", "vlm-vqa", claims=claims_vlm_checkpoint,
                         accepts="a LoongForge checkpoint of a vision-language model (held-out VQA accuracy)",
                         configure="loongforge_vlm.evaluate:configure", run="loongforge_vlm.evaluate:run")
    commands.add_generator("shapes", help="synthetic shapes VQA images (colour / shape / count questions)",
                           configure=configure_shapes, run="loongforge_vlm.data.shapes:make_data")
    commands.add_generator("shapes-pairs", help="image preference pairs on shapes images (a right and a wrong answer)",
                           configure="loongforge_vlm.data.shape_pairs:configure",
                           run="loongforge_vlm.data.shape_pairs:run")
