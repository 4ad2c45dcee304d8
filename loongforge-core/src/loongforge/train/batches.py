"""The run's tokenizer, dataset and per-rank batch iterator, resolved through the plugin registries, and the rows
an evaluation during training reads (``evaluation:``).

The validation rows are the held-out split of the training data (``data.valid_fraction``) or the whole of
``evaluation.data``, read by the same dataset kind and tokenizer; an evaluation reads the first
``evaluation.steps`` global batches of them, in order, so every evaluation sees the same sequences whatever the
parallel layout (:class:`ValidationSet`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from functools import partial
from itertools import islice
from typing import Any

from loongforge.config.schema import LoongForgeConfig
from loongforge.data.contracts import BalancedRows, PreferencePairs, PromptSet, SampleDataset
from loongforge.errors import ConfigError

#: Values of ``training.phase``.
PHASES = ("pretrain", "sft", "dpo", "grpo")


def load_tokenizer(host: Any, config: LoongForgeConfig) -> Any:
    """``data.tokenizer`` is ``kind`` or ``kind:argument`` (``byte``, ``hf:/dir``); the kind names a registry entry."""
    kind, _, argument = config.data.tokenizer.partition(":")
    factory = host.registry("tokenizer").load(kind, where=f"data.tokenizer in {config.source}")
    return factory(argument) if argument else factory()


def build_batches(host: Any, config: LoongForgeConfig, tokenizer: Any, *, rank: int, dp_rank: int, dp_size: int,
                  model: Any = None, num_microbatches: int = 1, dp_group: Any = None) -> tuple[Any, Any | None]:
    """The training split as an endless, resumable iterator of this data-parallel rank's micro-batches, and the
    validation rows (:func:`validation_rows`; ``None`` while ``evaluation.interval`` is 0).

    When a plugin answers ``loongforge_balance_samples`` (``dp-balance``) and the training split can re-place its
    samples per step (``balanced_batches``: variable-length data such as loongforge-vlm's), the split builds the
    iterator and calls the hook once per step of ``num_microbatches`` micro-batches over ``dp_group``; otherwise
    it is the plain sampler (the optimization then refuses the run at train start).

    Rank 0 tokenizes (and caches) first while the others wait, so several ranks never build one cache at once.
    A dataset factory that takes a ``model`` keyword gets the model's flavor (an image-text kind picks the
    vision encoder's processor and checks the tokenizer's vision tokens against it).
    """
    from loongforge.data.sampler import TrainBatchIterator

    train, held_out = split_dataset(_rank_zero_first(rank, lambda progress: open_dataset(
        host, config, tokenizer, model=model, progress=progress)), config)
    valid = None
    if config.evaluation.interval:
        valid = _rank_zero_first(rank, lambda progress: validation_rows(
            host, config, tokenizer, held_out, model=model, progress=progress))
    if isinstance(train, BalancedRows) and host.implements("loongforge_balance_samples"):
        return train.balanced_batches(
            partial(host.balance_samples, dp_group=dp_group), micro_batch_size=config.training.micro_batch_size,
            num_microbatches=num_microbatches, seed=config.run.seed, dp_rank=dp_rank, dp_size=dp_size,
        ), valid
    return TrainBatchIterator(
        train, config.training.micro_batch_size, config.run.seed, dp_rank=dp_rank, dp_size=dp_size
    ), valid


def _rank_zero_first(rank: int, build: Callable[[bool], Any]) -> Any:
    """``build(progress)`` on rank 0 (showing progress), then on the other ranks: a cache rank 0 writes is read by
    the others instead of being built by all at once."""
    import torch.distributed as dist  # here, not at the top: ``check`` opens datasets without a process group

    if rank == 0:
        built = build(True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if rank != 0:
        built = build(False)
    return built


def open_dataset(host: Any, config: LoongForgeConfig, tokenizer: Any, *, model: Any = None,
                 progress: bool = False) -> Any:
    """The dataset ``data.dataset`` names, opened by its kind's factory (which checks what it reads); a token stream
    also has its ids checked against the vocabulary -- a sample of a large file, all of a small one -- because an
    id past the model's embedding table fails only inside the forward pass, as an ``IndexError``.

    A factory that takes ``txt_split`` gets ``data.txt_split``. ``model`` is the run's model family: a factory that
    takes a ``model`` keyword gets it (an image-text kind picks
    the vision encoder's processor and checks the tokenizer's vision tokens against it), and its decoder's
    vocabulary bounds the ids. Pre-flight (``loongforge check``) and training open the data through this one call.
    """
    from loongforge.data.indexed import MMapTokenDataset

    factory = host.registry("dataset").load(config.data.dataset, where=f"data.dataset in {config.source}")
    accepted = inspect.signature(factory).parameters
    extra = {"model": model} if model is not None and "model" in accepted else {}
    if "txt_split" in accepted:
        extra["txt_split"] = config.data.txt_split
    dataset = factory(config.data.paths, tokenizer, text_key=config.data.text_key, progress=progress, **extra)
    if isinstance(dataset, MMapTokenDataset):
        vocabularies = {f"tokenizer '{tokenizer.name}'": tokenizer.vocab_size}
        if model is not None and model.decoder is not None:
            vocabularies[f"model '{config.model.name or model.family_name}'"] = model.decoder.vocab_size
        dataset.check_token_ids(vocabularies)
    return dataset


def split_dataset(dataset: Any, config: LoongForgeConfig) -> tuple[Any, Any]:
    """Train/valid samples: the dataset's own ``split_samples`` (chat data) or windows of a token stream.

    ``training.phase`` must agree with the data: ``sft`` trains on chat data with loss masks, ``dpo`` on preference
    pairs, ``pretrain`` on every token; a mismatch is almost always a config mistake, so it is an error rather than a
    guess.
    """
    from loongforge.data.gpt_dataset import train_valid_split

    phase, where = config.training.phase, config.source
    if phase not in PHASES:
        raise ConfigError(f"{where}: training.phase must be one of {', '.join(PHASES)}, got '{phase}'")
    kind = ("preference-pair" if isinstance(dataset, PreferencePairs) else "prompt" if isinstance(dataset, PromptSet)
            else "chat" if isinstance(dataset, SampleDataset) else "plain-text")
    needed = {"preference-pair": "dpo", "prompt": "grpo", "chat": "sft", "plain-text": "pretrain"}[kind]
    if phase != needed:
        raise ConfigError(
            f"{where}: data.dataset '{config.data.dataset}' is {kind} data but training.phase is '{phase}' (chat data "
            "needs phase sft, e.g. dataset sft or shipped-chat; preference pairs need phase dpo, e.g. dataset "
            "preference or shipped-preference; prompts need phase grpo, e.g. dataset prompts or shipped-tasks)"
        )
    if kind != "plain-text":
        return dataset.split_samples(config.data)
    if config.data.pack:
        raise ConfigError(f"{where}: data.pack applies to chat datasets; '{config.data.dataset}' is already "
                          "packed into full windows")
    return train_valid_split(dataset, config.data.seq_length, config.data.valid_fraction)


def check_pack(config: LoongForgeConfig, decoder: Any, cp: int) -> None:
    """``data.pack`` (rows packed from several samples, each attended on its own,
    :mod:`loongforge.parallel.packed_rows`; under context parallelism split per sequence,
    :mod:`loongforge.parallel.sequence_pieces`) and
    ``parallel.dynamic_cp_threshold`` against the layout and the decoder's attention; one line naming the key.
    Shared by the pre-flight and the run."""
    parallel, where = config.parallel, config.source
    if parallel.dynamic_cp_threshold < 0 or (parallel.dynamic_cp_threshold and not (config.data.pack and cp > 1)):
        raise ConfigError(f"{where}: parallel.dynamic_cp_threshold ({parallel.dynamic_cp_threshold}) applies to "
                          "packed rows (data.pack: true) with parallel.cp > 1 and must be >= 0; set it to 0")
    if not config.data.pack:
        return
    if decoder.masked_attention_blocker is not None:
        raise ConfigError(f"{where}: data.pack needs block-diagonal attention masks, which "
                          f"{decoder.masked_attention_blocker} does not take (causal only); set data.pack: false")
    if cp > 1 and ((parallel.vpp or 1) > 1 or parallel.sequence_parallel or decoder.is_moe
                   or decoder.position_embedding not in ("rope", "learned_absolute", "none")
                   or decoder.mrope_section is not None):
        raise ConfigError(f"{where}: data.pack with parallel.cp > 1 (rows re-laid per sequence, their length "
                          "varying per micro-batch, padding tokens added) needs no vpp (the interleaved schedule "
                          "cannot pass varying shapes), no sequence_parallel, a dense decoder (the padding would "
                          "reach MoE routers) and rotary or learned positions (not M-RoPE); change those or set "
                          "data.pack: false")


def validation_rows(host: Any, config: LoongForgeConfig, tokenizer: Any, held_out: Any, *, model: Any = None,
                    progress: bool = False) -> Any:
    """The rows an evaluation reads: every row of ``evaluation.data`` (opened and checked as ``data.paths`` are,
    by the same dataset kind, tokenizer and sequence length, with nothing held out), else ``held_out`` -- the
    training data's held-out split, ``None`` without ``data.valid_fraction``."""
    if not config.evaluation.data:
        return held_out
    data = dataclasses.replace(config.data, paths=list(config.evaluation.data), valid_fraction=0.0)
    separate = dataclasses.replace(config, data=data)
    rows, _ = split_dataset(open_dataset(host, separate, tokenizer, model=model, progress=progress), separate)
    return rows


def check_validation_source(config: LoongForgeConfig) -> None:
    """A megatron-engine run that evaluates needs somewhere to take validation rows from (one-line error)."""
    ev = config.evaluation
    if ev.interval and not ev.data and not config.data.valid_fraction > 0:
        raise ConfigError(f"{config.source}: evaluation.interval is {ev.interval} but there is no validation data: "
                          "set data.valid_fraction > 0 (hold out the end of the training data) or evaluation.data "
                          "(paths read like data.paths)")


def validation_batch_count(config: LoongForgeConfig, size: int, global_batch: int, origin: str) -> int:
    """Global batches per evaluation: ``evaluation.steps``, or all that ``size`` validation samples hold when they
    hold fewer; a one-line :class:`ConfigError` naming both numbers when they do not hold one. ``origin`` says
    where the samples come from, for the message."""
    if size < global_batch:
        raise ConfigError(f"{config.source}: evaluation: {origin} holds {size} sample(s), fewer than one global "
                          f"batch of {global_batch} (training.global_batch_size, or micro_batch_size x data-parallel "
                          "ranks); hold out more data or name more in evaluation.data")
    return min(config.evaluation.steps, size // global_batch)


def validation_origin(config: LoongForgeConfig) -> str:
    """Where a megatron-engine run's validation rows come from, as messages name it."""
    if config.evaluation.data:
        return f"evaluation.data ({', '.join(config.evaluation.data)})"
    return f"the held-out split (data.valid_fraction {config.data.valid_fraction})"


def validation_set(config: LoongForgeConfig, rows: Any, global_batch: int) -> ValidationSet:
    """What a megatron-engine evaluation reads, from the rows :func:`build_batches` returned (checked in one line:
    there are some, and enough for one global batch)."""
    check_validation_source(config)
    return ValidationSet(rows, validation_batch_count(config, len(rows), global_batch, validation_origin(config)))


@dataclasses.dataclass(frozen=True)
class ValidationSet:
    """The rows an evaluation reads and how many global batches of them: the first ``batches`` global batches, in
    order. Global batch ``b``'s micro-batch ``m`` on data-parallel rank ``r`` holds the rows from
    ``b x G + m x micro x dp + r x micro`` on (``G`` the global batch), exactly as a training step deals its
    batch, so every layout evaluates the same rows."""

    rows: Any
    batches: int

    def micro_batches(self, micro_batch_size: int, num_microbatches: int, *, dp_rank: int,
                      dp_size: int) -> Iterator[dict[str, Any]]:
        """This rank's micro-batches of one evaluation (``batches x num_microbatches`` of them)."""
        from loongforge.data.sampler import eval_batches

        every = eval_batches(self.rows, micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
        return islice(every, self.batches * num_microbatches)
