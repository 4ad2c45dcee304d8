"""Core's handlers for ``loongforge convert``: Hugging Face decoder LLM directories <-> LoongForge checkpoints.

Registered through core's own ``loongforge_register_commands`` (:mod:`loongforge.builtin`) like any plugin's
converter; ``loongforge convert`` runs the handler whose ``claims(source)`` is true (:mod:`loongforge.commands`).
The conversions themselves are :mod:`loongforge.interop.convert`.
"""

from __future__ import annotations

import argparse

from loongforge.claims import checkpoint_model, hf_config_names
from loongforge.commands import CommandRegistry


def claims_hf_decoder(source: str, *, trust_code: bool) -> bool:
    """A Hugging Face directory whose ``config.json`` names a decoder family core reads (by architecture, or by
    ``model_type`` when it names no architecture)."""
    from loongforge.models.hf_layouts import FAMILIES

    arch, model_type = hf_config_names(source)
    if arch is not None:
        return arch in {row[0] for row in FAMILIES.values()}
    return model_type in {row[1] for row in FAMILIES.values()}


def claims_decoder_checkpoint(source: str, *, trust_code: bool) -> bool:
    """A LoongForge checkpoint of a megatron decoder LLM (a :class:`~loongforge.models.flavor.DecoderFlavor`)."""
    from loongforge.models.flavor import DecoderFlavor

    return isinstance(checkpoint_model(source, trust_code=trust_code), DecoderFlavor)


def _hf_decoder_accepts() -> str:
    from loongforge.models.hf_layouts import FAMILIES

    return f"a Hugging Face directory whose config.json architectures is {'/'.join(r[0] for r in FAMILIES.values())}"


def configure_hf_to_mcore(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="registered model name the checkpoint must match (default: inferred)")


def configure_mcore_to_hf(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-shard-size", default="5GB", help="split safetensors above this size (default 5GB)")


def run_hf_to_mcore(args: argparse.Namespace) -> int:
    from loongforge.interop.convert import hf_to_mcore

    print(hf_to_mcore(args.source, args.out, model=args.model))
    return 0


def run_mcore_to_hf(args: argparse.Namespace) -> int:
    from loongforge.interop.convert import mcore_to_hf

    print(mcore_to_hf(args.source, args.out, max_shard_size=args.max_shard_size, trust_code=args.trust_code))
    return 0


def register_core_converters(commands: CommandRegistry) -> None:
    commands.add_handler("convert hf-to-mcore", "hf-decoder", accepts=_hf_decoder_accepts(),
                         claims=claims_hf_decoder, configure=configure_hf_to_mcore, run=run_hf_to_mcore)
    commands.add_handler("convert mcore-to-hf", "decoder-checkpoint",
                         accepts="a LoongForge checkpoint (step directory or checkpoint root) of a decoder LLM",
                         claims=claims_decoder_checkpoint, configure=configure_mcore_to_hf, run=run_mcore_to_hf)
