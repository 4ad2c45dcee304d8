"""Core's ``loongforge eval`` handler for language models (lm-eval tasks, perplexity), registered like a plugin's.

Torch-free until it runs: the claim reads a checkpoint's saved config or a Hugging Face ``config.json``. It claims
language models only -- a model that is its own decoder -- so a vision-language checkpoint still reaches its plugin's
evaluator and a task-engine model (a policy, a DiT) its own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loongforge.claims import checkpoint_model
from loongforge.commands import CommandRegistry
from loongforge.errors import LoongForgeError

ACCEPTS = ("a LoongForge checkpoint or Hugging Face directory of a language model (lm-eval tasks: --tasks; "
           "held-out perplexity: --perplexity)")


def claims_language_model(source: str, *, trust_code: bool) -> bool:
    """A LoongForge checkpoint, or a Hugging Face directory an installed family reads, of a megatron model that is
    its own decoder (an LLM, not a composed model)."""
    from loongforge.interop.model_source import is_hf_directory

    path = Path(source).expanduser()
    if is_hf_directory(path):
        from loongforge.core_converters import claims_hf_directory
        from loongforge.models.hf_format import read_hf_model

        if not claims_hf_directory(source, trust_code=trust_code):
            return False
        model = read_hf_model(path).family
    else:
        model = checkpoint_model(source, trust_code=trust_code)
    return model is not None and model.engine == "megatron" and model.decoder is model


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", action="append", default=[], metavar="TASK[,TASK...]",
                        help="lm-eval tasks: the path of a task YAML (lm-eval's format; dataset_path: json with "
                             "local data_files) or a task name lm-eval knows (its data from the Hub or its cache); "
                             "comma-separated or repeated")
    parser.add_argument("--perplexity", type=Path, metavar="FILE",
                        help="also score held-out text: a .txt (documents between blank lines) or a .jsonl with a "
                             "'text' per line; reports word and byte perplexity and bits per byte")
    parser.add_argument("--batch-size", type=int, default=8, metavar="N", help="sequences per forward (default 8)")
    parser.add_argument("--max-gen-toks", type=int, default=256, metavar="N",
                        help="new tokens per generation when a task sets none (default 256)")
    parser.add_argument("--limit", type=int, metavar="N", help="evaluate only the first N documents of each task")
    parser.add_argument("--tokenizer", metavar="SPEC", help="override the checkpoint's tokenizer: byte or hf:/dir")
    parser.add_argument("--output", type=Path, metavar="FILE",
                        help="write the scores as JSON ({task: {metric: value}} under 'results', with each task's "
                             "config and sample count)")


def run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm is imported: our progress lines replace its bars
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise LoongForgeError("loongforge eval on a language model runs lm-evaluation-harness: pip install "
                              "'loongforge-core[eval]'") from None
    from lm_eval.utils import make_table

    from loongforge.evaluation.harness import evaluate_language_model

    tasks = [name.strip() for value in args.tasks for name in value.split(",") if name.strip()]
    for name, value in (("--batch-size", args.batch_size), ("--max-gen-toks", args.max_gen_toks),
                        ("--limit", args.limit if args.limit is not None else 1)):
        if value < 1:
            raise LoongForgeError(f"{name} must be >= 1, got {value}")
    results = evaluate_language_model(args.source, tasks, perplexity=args.perplexity, batch_size=args.batch_size,
                                      max_gen_toks=args.max_gen_toks, limit=args.limit, trust_code=args.trust_code,
                                      tokenizer=args.tokenizer)
    if int(os.environ.get("RANK", "0")) == 0:
        print(make_table(results))
        if args.output is not None:
            kept = {key: results[key] for key in ("results", "configs", "n-samples", "versions") if key in results}
            args.output.write_text(json.dumps(kept, indent=1, default=str) + "\n", encoding="utf-8")
            print(f"scores: {args.output}")
    return 0


def register_eval_handler(commands: CommandRegistry) -> None:
    commands.add_handler("eval", "lm-eval", claims=claims_language_model, accepts=ACCEPTS,
                         configure="loongforge.evaluation.command:configure",
                         run="loongforge.evaluation.command:run")
