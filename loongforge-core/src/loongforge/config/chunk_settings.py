"""``parallel.seq_chunks`` checked against the model and the rest of the run, without importing torch: the pre-flight
(``check``, ``train``) and the planner (``loongforge plan`` plans a cluster on a laptop) read it; the mechanism is
:mod:`loongforge.parallel.sequence_chunks`."""

from __future__ import annotations

from typing import Any

from loongforge.errors import ConfigError

__all__ = ["TILE", "check_seq_chunks", "chunk_counts", "chunk_tile", "seq_chunks_problem"]

#: The fewest tokens a chunk the planner chooses keeps (shorter chunks cost more in per-pass overhead than they save).
MIN_CHUNK_TOKENS = 256
#: The most chunks the planner cuts a sequence into.
MAX_CHUNKS = 64
#: The chunk attention's longest run of queries or keys whose scores are computed at once (``heads x TILE x TILE``
#: fp32 numbers; :mod:`loongforge.devices.chunk_attention`, which the planner's memory model sizes without torch).
TILE = 512


def chunk_tile(length: int, most: int = TILE) -> int:
    """The tile length of a ``length``-token chunk: halved while longer than ``most`` (and even), so tiles cover it."""
    while length > most and length % 2 == 0:
        length //= 2
    return length


def seq_chunks_problem(config: Any, decoder: Any, *, chunks: int | None, cp: int, vpp: int | None) -> str | None:
    """What rules out the chunked pipeline for this run (``chunks`` of the sequence; ``None``: any count, as the
    planner asks), or None; the first refusal that holds."""
    seq, phase = config.data.seq_length, config.training.phase
    refusals = (
        (chunks is not None and seq % chunks, f"data.seq_length ({seq}) does not divide into {chunks} equal chunks"),
        (cp > 1, "not with parallel.cp > 1 (chunks and context parallelism both split the sequence)"),
        (vpp, "not with parallel.vpp (the interleaved schedule)"),
        (config.data.pack, "not with data.pack (packed rows restart positions inside a chunk)"),
        (phase not in ("pretrain", "sft"), f"not with training.phase {phase} (its engine steps pairs or rollouts)"),
        (decoder.is_moe, "not with a mixture-of-experts decoder (routing and its balancing loss are per micro-batch)"),
        (decoder.context_parallel_blocker, f"not with {decoder.context_parallel_blocker} (core's attention applies it "
                                           "over whole sequences)"),
        (decoder.position_embedding not in ("rope", "learned_absolute", "none") or decoder.mrope_section,
         f"not with position embedding '{decoder.position_embedding}'{' (M-RoPE)' if decoder.mrope_section else ''}"),
    )
    why = next((why for refused, why in refusals if refused), None)
    if why is None and decoder.decoder_spec() is not None:  # asked last: a family's spec may import megatron
        why = "not with the decoder's own layers (only core's causal attention keeps K/V per chunk)"
    return why


def check_seq_chunks(config: Any, decoder: Any, *, cp: int, vpp: int | None) -> None:
    """``parallel.seq_chunks`` against the run, in one line naming the key: what the chunked pipeline cannot do.
    ``auto`` is the planner's to choose (``parallel: auto``); it is checked against the model alone, the planner
    keeping chunks to layouts without cp or vpp. Shared by the pre-flight and the run."""
    chunks, where = config.parallel.seq_chunks, config.source
    if chunks == "auto":
        if not config.parallel.auto:
            raise ConfigError(f"{where}: parallel.seq_chunks auto is the planner's to choose: set parallel: auto, or "
                              "write a config with loongforge plan --write")
        why = seq_chunks_problem(config, decoder, chunks=None, cp=1, vpp=None)
        if why is not None:
            raise ConfigError(f"{where}: parallel.seq_chunks (auto): {why}; set parallel.seq_chunks: 1")
        return
    if chunks < 1:
        raise ConfigError(f"{where}: parallel.seq_chunks must be >= 1 or auto, got {chunks}")
    if chunks == 1:
        return
    why = seq_chunks_problem(config, decoder, chunks=chunks, cp=cp, vpp=vpp)
    if why is not None:
        raise ConfigError(f"{where}: parallel.seq_chunks ({chunks}): {why}; set parallel.seq_chunks: 1")


def chunk_counts(config: Any, decoder: Any) -> tuple[int, ...]:
    """The chunk counts a planned layout may take: the config's fixed count, or for ``auto`` 1 and every power of two
    up to :data:`MAX_CHUNKS` that cuts ``data.seq_length`` into chunks of at least :data:`MIN_CHUNK_TOKENS` tokens
    (none where the model rules chunking out)."""
    chunks, seq = config.parallel.seq_chunks, config.data.seq_length
    if chunks != "auto":
        return (chunks,)
    if seq_chunks_problem(config, decoder, chunks=None, cp=1, vpp=None) is not None:
        return (1,)
    counts, count = [1], 2
    while count <= MAX_CHUNKS and seq % count == 0 and seq // count >= MIN_CHUNK_TOKENS:
        counts.append(count)
        count *= 2
    return tuple(counts)
