"""The run's tokenizer, dataset and per-rank batch iterator, resolved through the plugin registries."""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import torch.distributed as dist

from loongforge.config.schema import LoongForgeConfig
from loongforge.data.contracts import BalancedRows, SampleDataset
from loongforge.errors import ConfigError

#: Values of ``training.phase``.
PHASES = ("pretrain", "sft")


def load_tokenizer(host: Any, config: LoongForgeConfig) -> Any:
    """``data.tokenizer`` is ``kind`` or ``kind:argument`` (``byte``, ``hf:/dir``); the kind names a registry entry."""
    kind, _, argument = config.data.tokenizer.partition(":")
    factory = host.registry("tokenizer").load(kind, where=f"data.tokenizer in {config.source}")
    return factory(argument) if argument else factory()


def build_batches(host: Any, config: LoongForgeConfig, tokenizer: Any, *, rank: int, dp_rank: int, dp_size: int,
                  model: Any = None, num_microbatches: int = 1, dp_group: Any = None) -> Any:
    """The training split as an endless, resumable iterator of this data-parallel rank's micro-batches.

    When a plugin answers ``loongforge_balance_samples`` (``dp-balance``) and the training split can re-place its
    samples per step (``balanced_batches``: variable-length data such as loongforge-vlm's), the split builds the
    iterator and calls the hook once per step of ``num_microbatches`` micro-batches over ``dp_group``; otherwise
    it is the plain sampler (the optimization then refuses the run at train start).

    Rank 0 tokenizes (and caches) first while the others wait, so several ranks never build one cache at once.
    A dataset factory that takes a ``model`` keyword gets the model's flavor (an image-text kind picks the
    vision encoder's processor and checks the tokenizer's vision tokens against it).
    """
    from loongforge.data.sampler import TrainBatchIterator

    def tokens() -> Any:
        return open_dataset(host, config, tokenizer, model=model, progress=rank == 0)

    if rank == 0:
        dataset = tokens()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if rank != 0:
        dataset = tokens()
    train, _ = split_dataset(dataset, config)
    if isinstance(train, BalancedRows) and host.implements("loongforge_balance_samples"):
        return train.balanced_batches(
            partial(host.balance_samples, dp_group=dp_group), micro_batch_size=config.training.micro_batch_size,
            num_microbatches=num_microbatches, seed=config.run.seed, dp_rank=dp_rank, dp_size=dp_size,
        )
    return TrainBatchIterator(
        train, config.training.micro_batch_size, config.run.seed, dp_rank=dp_rank, dp_size=dp_size
    )


def open_dataset(host: Any, config: LoongForgeConfig, tokenizer: Any, *, model: Any = None,
                 progress: bool = False) -> Any:
    """The dataset ``data.dataset`` names, opened by its kind's factory (which checks what it reads); a token stream
    also has its ids checked against the vocabulary -- a sample of a large file, all of a small one -- because an
    id past the model's embedding table fails only inside the forward pass, as an ``IndexError``.

    ``model`` is the run's model family: a factory that takes a ``model`` keyword gets it (an image-text kind picks
    the vision encoder's processor and checks the tokenizer's vision tokens against it), and its decoder's
    vocabulary bounds the ids. Pre-flight (``loongforge check``) and training open the data through this one call.
    """
    from loongforge.data.indexed import MMapTokenDataset

    factory = host.registry("dataset").load(config.data.dataset, where=f"data.dataset in {config.source}")
    extra = {"model": model} if model is not None and "model" in inspect.signature(factory).parameters else {}
    dataset = factory(config.data.paths, tokenizer, text_key=config.data.text_key, progress=progress, **extra)
    if isinstance(dataset, MMapTokenDataset):
        vocabularies = {f"tokenizer '{tokenizer.name}'": tokenizer.vocab_size}
        if model is not None and model.decoder is not None:
            vocabularies[f"model '{config.model.name or model.family_name}'"] = model.decoder.vocab_size
        dataset.check_token_ids(vocabularies)
    return dataset


def split_dataset(dataset: Any, config: LoongForgeConfig) -> tuple[Any, Any]:
    """Train/valid samples: the dataset's own ``split_samples`` (chat data) or windows of a token stream.

    ``training.phase`` must agree with the data: ``sft`` trains on chat data with loss masks, ``pretrain`` on
    every token; a mismatch is almost always a config mistake, so it is an error rather than a guess.
    """
    from loongforge.data.gpt_dataset import train_valid_split

    phase, where = config.training.phase, config.source
    if phase not in PHASES:
        raise ConfigError(f"{where}: training.phase must be one of {', '.join(PHASES)}, got '{phase}'")
    chat = isinstance(dataset, SampleDataset)
    if chat != (phase == "sft"):
        raise ConfigError(
            f"{where}: data.dataset '{config.data.dataset}' is {'chat' if chat else 'plain-text'} data but "
            f"training.phase is '{phase}' (chat data needs phase sft, e.g. dataset sft or shipped-chat)"
        )
    if chat:
        return dataset.split_samples(config.data)
    if config.data.pack:
        raise ConfigError(f"{where}: data.pack applies to chat datasets; '{config.data.dataset}' is already "
                          "packed into full windows")
    return train_valid_split(dataset, config.data.seq_length, config.data.valid_fraction)
