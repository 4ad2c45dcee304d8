"""Core's handlers for ``loongforge convert``: Hugging Face directories <-> LoongForge checkpoints of megatron models.

Registered through core's own ``loongforge_register_commands`` (:mod:`loongforge.builtin`) like any plugin's
converter; ``loongforge convert`` runs the handler whose ``claims(source)`` is true (:mod:`loongforge.commands`).
The conversions themselves are :mod:`loongforge.interop.convert`.
"""

from __future__ import annotations

import argparse

from loongforge.claims import checkpoint_model, hf_config_names
from loongforge.commands import CommandRegistry


def claims_hf_directory(source: str, *, trust_code: bool) -> bool:
    """A Hugging Face directory whose ``config.json`` names an architecture (or, without one, a ``model_type``) that
    an installed family registered a reader for (``loongforge_register_hf_architectures``): core's decoders and any
    plugin's convert the same way, through the family's adapter."""
    from loongforge.plugins import get_host

    arch, model_type = hf_config_names(source)
    key = arch if arch is not None else model_type
    return key is not None and key in get_host().registry("hf_architecture")


def claims_hf_exportable_checkpoint(source: str, *, trust_code: bool) -> bool:
    """A LoongForge checkpoint of a megatron-engine model whose family has a Hugging Face adapter."""
    model = checkpoint_model(source, trust_code=trust_code)
    return model is not None and model.engine == "megatron" and model.hf_adapter() is not None


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
    commands.add_handler("convert hf-to-mcore", "hf-model",
                         accepts="a Hugging Face directory whose config.json architecture an installed family reads "
                                 "(loongforge list hf_architectures)",
                         claims=claims_hf_directory, configure=configure_hf_to_mcore, run=run_hf_to_mcore)
    commands.add_handler("convert mcore-to-hf", "hf-exportable-checkpoint",
                         accepts="a LoongForge checkpoint (step directory or checkpoint root) of a model whose family "
                                 "has a Hugging Face adapter",
                         claims=claims_hf_exportable_checkpoint, configure=configure_mcore_to_hf, run=run_mcore_to_hf)
