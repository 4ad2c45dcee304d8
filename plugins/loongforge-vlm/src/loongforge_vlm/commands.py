"""What the ``vlm`` plugin adds to the ``loongforge`` command line: VQA evaluation of a VLM checkpoint (``loongforge
eval``), the synthetic shapes set (``loongforge make-data shapes``) and preference pairs on shapes images
(``loongforge make-data shapes-pairs``). Conversion both ways needs nothing here: the family registers its Hugging
Face reader and adapter (:mod:`loongforge_vlm.model.hf_adapter`), so core's ``loongforge convert`` handlers, like
``generate``, ``diff`` and ``model.load: hf:``, read and write VLM directories.

Torch-free: the claim reads a checkpoint's saved config; the evaluator and the generators are registered by import
path and load when they run. The generator's options are set up here, because every generator's are whenever
``make-data`` is parsed, and the drawing module imports numpy and Pillow.
"""

from __future__ import annotations

import argparse

from loongforge.claims import checkpoint_model
from loongforge.commands import CommandRegistry


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
    commands.add_handler("eval", "vlm-vqa", claims=claims_vlm_checkpoint,
                         accepts="a LoongForge checkpoint of a vision-language model (held-out VQA accuracy)",
                         configure="loongforge_vlm.evaluate:configure", run="loongforge_vlm.evaluate:run")
    commands.add_generator("shapes", help="synthetic shapes VQA images (colour / shape / count questions)",
                           configure=configure_shapes, run="loongforge_vlm.data.shapes:make_data")
    commands.add_generator("shapes-pairs", help="image preference pairs on shapes images (a right and a wrong answer)",
                           configure="loongforge_vlm.data.shape_pairs:configure",
                           run="loongforge_vlm.data.shape_pairs:run")
