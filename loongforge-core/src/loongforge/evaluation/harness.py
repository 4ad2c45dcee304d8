"""``loongforge eval`` for language models: lm-evaluation-harness tasks and held-out perplexity on a checkpoint.

The model is what ``loongforge generate`` builds (:func:`~loongforge.interop.model_source.open_model_source`: a
LoongForge checkpoint, a LoRA run's adapters merged, or a Hugging Face directory), here at the tensor-parallel size of
the world it runs in (``torchrun --nproc-per-node 2 -m loongforge.cli eval ...``: the checkpoint resharded on loading);
lm-eval asks it through :class:`~loongforge.evaluation.lm.LoongForgeLM`.

Tasks are lm-eval's: a name lm-eval knows (its datasets come from the Hub, so they need a network or a filled
``HF_DATASETS_CACHE``), or the path of a task YAML -- lm-eval's own format, whose ``dataset_path: json`` with
``dataset_kwargs: {data_files: ...}`` reads local files (relative ``data_files`` are taken from the YAML's directory).
``--perplexity FILE`` scores a held-out text file (paragraphs of a ``.txt``, or the ``text`` of each ``.jsonl`` line)
with lm-eval's rolling log-likelihood metrics: word and byte perplexity and bits per byte.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from loongforge.errors import LoongForgeError

#: The task lm-eval runs for ``--perplexity``: every document's rolling log-likelihood.
PERPLEXITY_TASK = "loongforge_perplexity"


def _task_yaml(path: Path, directory: Path) -> str:
    """Copy the task YAML ``path`` into ``directory`` (what lm-eval's task manager indexes) with its relative
    ``data_files`` made absolute; returns its ``task`` name."""
    try:
        task = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise LoongForgeError(f"task file {path}: {exc}") from None
    if not isinstance(task, dict) or not isinstance(task.get("task"), str):
        raise LoongForgeError(f"task file {path}: no 'task: NAME' at its top level (an lm-eval task YAML)")
    files = (task.get("dataset_kwargs") or {}).get("data_files")
    if files is not None:
        task["dataset_kwargs"]["data_files"] = _absolute(files, path.parent)
    (directory / f"{path.stem}.yaml").write_text(yaml.safe_dump(task, sort_keys=False), encoding="utf-8")
    return task["task"]


def _absolute(files: Any, base: Path) -> Any:
    if isinstance(files, str):
        return str((base / files).expanduser().resolve())
    if isinstance(files, list):
        return [_absolute(item, base) for item in files]
    if isinstance(files, dict):
        return {split: _absolute(item, base) for split, item in files.items()}
    return files


def read_documents(path: Path) -> list[str]:
    """The non-empty documents of a perplexity file, read as ``loongforge preprocess`` reads its inputs
    (:func:`loongforge.data.sources.iter_documents`: a ``.txt``'s paragraphs, a ``.jsonl``'s ``text`` fields)."""
    from loongforge.data.sources import check_inputs, iter_documents

    (checked,) = check_inputs([path])
    documents = [text for text, _ in iter_documents(checked) if text.strip()]
    if not documents:
        raise LoongForgeError(f"perplexity file {path}: no documents")
    return documents


def _perplexity_yaml(path: Path, directory: Path) -> str:
    """Write the held-out documents of ``path`` and the task that scores them into ``directory``."""
    data = directory / "perplexity.jsonl"
    data.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in read_documents(path)), encoding="utf-8")
    task = {
        "task": PERPLEXITY_TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test", "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
        "should_decontaminate": False,
        "metric_list": [{"metric": name} for name in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
    }
    (directory / f"{PERPLEXITY_TASK}.yaml").write_text(yaml.safe_dump(task, sort_keys=False), encoding="utf-8")
    return PERPLEXITY_TASK


@contextlib.contextmanager
def task_directory(tasks: list[str], perplexity: Path | None) -> Iterator[tuple[list[str], Path]]:
    """``(task names, directory of the task YAMLs)`` for lm-eval: each of ``tasks`` that is a YAML file copied in
    (its name used), every other name kept for lm-eval to find among its own."""
    with tempfile.TemporaryDirectory(prefix="loongforge-eval-") as tmp:
        directory = Path(tmp)
        names = []
        for task in tasks:
            path = Path(task).expanduser()
            if path.suffix in (".yaml", ".yml"):
                if not path.is_file():
                    raise LoongForgeError(f"task file {path} not found")
                names.append(_task_yaml(path, directory))
            else:
                names.append(task)
        if perplexity is not None:
            names.append(_perplexity_yaml(perplexity, directory))
        if not names:
            raise LoongForgeError("nothing to evaluate: give --tasks and/or --perplexity")
        yield names, directory


class _RequestProgress:
    """One progress display per kind of request lm-eval sends (log-likelihood, generation), opened when the first
    batch of that kind reports."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack, self._kind, self._progress, self._shown = stack, None, None, 0

    def __call__(self, what: str, done: int, total: int) -> None:
        from loongforge.progress import job_progress

        if self._kind != (what, total):
            self._kind, self._shown = (what, total), 0
            self._progress = self._stack.enter_context(job_progress(f"eval {what}", total, unit="request",
                                                                    stderr=True))
        self._progress.advance(done - self._shown)
        self._shown = done


def evaluate_language_model(source: str, tasks: list[str], *, perplexity: Path | None = None,
                            batch_size: int = 8, max_gen_toks: int = 256, limit: int | None = None,
                            trust_code: bool = False, tokenizer: str | None = None) -> dict[str, Any]:
    """lm-eval's results dict (``results`` per task and metric, ``configs``, ``n-samples`` ...) for the model in
    ``source``, at the tensor-parallel size of the running world (empty on ranks other than 0). ``limit`` caps the
    documents per task."""
    import torch.distributed as dist

    from loongforge.evaluation.lm import LoongForgeLM
    from loongforge.interop.generate import source_tokenizer, stop_ids
    from loongforge.interop.mcore_checkpoint import HF_SOURCE

    with task_directory(tasks, perplexity) as (names, directory), loaded_model(source, trust_code) as (model, info):
        spec, tok = source_tokenizer(info, tokenizer)
        stops = stop_ids(info.path if info.is_hf else info.path / HF_SOURCE, spec, tok)
        with contextlib.ExitStack() as stack:
            lm = LoongForgeLM(model, tok, vocab_size=info.family.decoder.vocab_size,
                              max_length=info.family.decoder.max_position_embeddings, stop_ids=sorted(stops),
                              batch_size=batch_size, max_gen_toks=max_gen_toks, on_batch=_RequestProgress(stack))
            results = run_lm_eval(lm, names, directory, limit)
        if dist.is_initialized():
            dist.barrier()
    return results


def run_lm_eval(lm: Any, names: list[str], directory: Path, limit: int | None) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of ``lm`` on tasks ``names`` (those defined by YAMLs in ``directory`` among them),
    seeded alike every time; empty on the ranks lm-eval does not report on (all but local rank 0)."""
    import logging
    import os
    from unittest import mock

    import lm_eval
    import lm_eval.evaluator
    from lm_eval.tasks import TaskManager

    # a task YAML without aggregation / direction keys is normal (lm-eval's defaults apply): no warning per metric
    logging.getLogger("lm_eval.api.task").setLevel(logging.ERROR)
    # lm-eval records the git commit of the working directory (running git, which complains outside a repository):
    # that is not the evaluated model's, so none is recorded
    with mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None):
        results = lm_eval.simple_evaluate(
            model=lm, tasks=names, task_manager=TaskManager(include_path=str(directory)), limit=limit,
            log_samples=False, bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
            fewshot_random_seed=0,
        )
    if results is None and int(os.environ.get("RANK", "0")) == 0:
        raise LoongForgeError("lm-eval returned no results")
    return results or {}  # lm-eval reports on rank 0 only (under torchrun every rank is its one process)


def flat_scores(results: dict[str, Any]) -> dict[str, float]:
    """``{"<task>/<metric>": value}`` of lm-eval's results (standard errors left out; a metric under a filter other
    than lm-eval's default ``none`` is named ``<metric>[<filter>]``)."""
    scores = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            # metrics are "<metric>,<filter>"; other keys (alias, sample_len) describe the task
            if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool) or "_stderr" in key:
                continue
            metric, _, applied = key.partition(",")
            scores[f"{task}/{metric}" if applied == "none" else f"{task}/{metric}[{applied}]"] = float(value)
    return scores


def check_evaluation_tasks(config: Any, family: Any, layout: Any) -> None:
    """Refuse ``evaluation.tasks`` a run cannot score, in one line naming the key: no evaluations, a model that is not
    a language model, a preference or RL phase, a layout the scorer cannot run (pp > 1, cp > 1), a task YAML that is
    missing, or lm-eval not installed."""
    tasks = config.evaluation.tasks
    if not tasks:
        return
    where = f"{config.source}: evaluation.tasks"
    if config.evaluation.interval == 0:
        raise LoongForgeError(f"{where} is set but evaluation.interval is 0: set an interval to score the tasks")
    if family.engine != "megatron" or family.decoder is not family:
        raise LoongForgeError(f"{where} scores language models; model '{config.model.name}' is a "
                              f"{family.family_name} model")
    if config.training.phase in ("dpo", "grpo"):
        raise LoongForgeError(f"{where} scores pretraining and SFT runs, not training.phase {config.training.phase}")
    if layout is not None and (layout.pp > 1 or layout.cp > 1):  # None: parallel auto, chosen at train time
        raise LoongForgeError(f"{where} needs the whole model on each rank's pipeline and sequence (pp=1, cp=1); "
                              f"this layout has pp={layout.pp} cp={layout.cp}")
    for task in tasks:
        path = Path(task).expanduser()
        if path.suffix in (".yaml", ".yml") and not path.is_file():
            raise LoongForgeError(f"{where}: task file {path} not found")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise LoongForgeError(f"{where} runs lm-evaluation-harness: pip install 'loongforge-core[eval]'") from None


def task_scores(model: Any, tokenizer: Any, decoder: Any, tasks: list[str], *, limit: int | None = None,
                batch_size: int = 8) -> dict[str, float]:
    """:func:`flat_scores` of lm-eval ``tasks`` on a training run's model (``evaluation.tasks``): its one chunk
    (unwrapped from megatron's DDP), scored in eval mode, the mode it was in restored after."""
    from loongforge.checkpoint.saver import unwrap_model
    from loongforge.evaluation.lm import LoongForgeLM

    plain = unwrap_model(model)
    was_training = plain.training
    plain.eval()
    try:
        with task_directory(tasks, None) as (names, directory):
            lm = LoongForgeLM(plain, tokenizer, vocab_size=decoder.vocab_size,
                              max_length=decoder.max_position_embeddings, stop_ids=[], batch_size=batch_size)
            return flat_scores(run_lm_eval(lm, names, directory, limit))
    finally:
        plain.train(was_training)


@contextlib.contextmanager
def loaded_model(source: str, trust_code: bool) -> Iterator[tuple[Any, Any]]:
    """``(model, ModelSource)``: the model in ``source`` built and filled at the tensor-parallel size of the world
    (torchrun's ``WORLD_SIZE``, 1 without it), inside its megatron world."""
    import os
    import sys

    from loongforge.interop.mcore_checkpoint import load_trained_weights
    from loongforge.interop.model_source import open_model_source
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import ChunkBuild
    from loongforge.models.decoder_model import ParallelSettings

    info = open_model_source(source, trust_code=trust_code, command="`loongforge eval`")
    if info.family.decoder is not info.family:
        raise LoongForgeError(f"{info.path}: `loongforge eval` with tasks scores language models; this is a "
                              f"{info.family.family_name} model")
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    if tp > 1 and info.is_hf:
        raise LoongForgeError(f"{info.path}: a Hugging Face directory is evaluated in one process; convert it "
                              "(loongforge convert hf-to-mcore) to evaluate it at tensor-parallel size "
                              f"{tp}")
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[loongforge] eval: {info.path} ({info.family.family_name}, {info.dtype}) at tensor-parallel size {tp}",
              file=sys.stderr)
    with standalone_world(tp_size=tp) as backend:
        build = ChunkBuild(backend=backend, params_dtype=info.dtype, parallel=ParallelSettings(tp=tp), seed=None)
        model = info.family.build_chunk(build)
        if info.is_hf:
            model = info.load(model)
        else:
            load_trained_weights(info.path, [model], info.config)
        model.eval()
        yield model, info
