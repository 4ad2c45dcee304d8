"""Text generation from a megatron model: greedy, or temperature + top-k / top-p (nucleus) sampling, for a batch
of prompts, with a KV cache.

**KV cache.** A megatron ``GPTModel`` (every core decoder family) decodes incrementally through megatron-core's
own static-batching inference path: a :class:`~megatron.core.inference.contexts.StaticInferenceContext` passed
as ``inference_context`` makes each attention layer keep its keys and values, so after the prompt (the prefill)
every step feeds one token per prompt. It runs on CPU unmodified under the CPU backend's patches (the cache
buffers are allocated in ``megatron.core.transformer.attention``, which already sees the CPU view of ``torch``).
A composed model (a VLM) decodes through the cache of the ``GPTModel`` it runs when it says so
(:class:`ComposedDecoder`). M-RoPE is cached too, with one difference: megatron computes its rotary table from the
position ids it is given, and the cached attention rotates every cached key by that table's first rows each step,
so a cached M-RoPE step is given the positions of the whole context (only its new tokens). Models outside that
path -- a sequence-parallel training model (one token cannot be split over ranks; its recomputed contexts are
left-padded to a multiple of the tensor-parallel size), attention that keeps no cache -- recompute the whole
context each token, which gives the same tokens, only slower (``use_cache=False`` forces that path). Once a
context outgrows the model's maximum positions, the cache is dropped and each step recomputes the last
``max_positions`` tokens, as it always did without a cache.

**Media.** Prompts a family prepared with media files (:class:`loongforge.models.media.MediaPrompts`) bring the
forward inputs that carry the files, given to the prefill only (and to every recomputation without a cache), and
their own positions: each prompt's (with several axes for M-RoPE), then for each new token its index among the
prompt's real tokens plus the prompt's offset (M-RoPE's rope delta), as transformers places it. Such a context
cannot slide (it would cut placeholders off their features), so prompts and new tokens must fit the positions.

**Batches.** Prompts of different lengths are left-padded into one batch. An explicit attention mask hides the
padding from every real token (a padded query sees itself only, so its row stays finite and cannot poison the
cache); positions count real tokens only, so learned position embeddings see each prompt from 0, and RoPE only
depends on distances between tokens, which padding does not change. A prompt that stops (at one of ``stop_ids``) keeps
a masked placeholder column while the others go on. Each prompt samples from its own generator seeded with
``seed``, so what a prompt generates does not depend on the prompts batched with it.

Only ids below ``vocab_size`` (the tokenizer's) are ever chosen: megatron pads the vocabulary, and the padded
rows are cut off before the choice. Every tensor-parallel rank must call :func:`generate_batch` (the forward
pass is collective); pipeline parallelism is not supported here. Sampling draws from private generators, so it
never perturbs the training RNG streams.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from loongforge.errors import LoongForgeError
from loongforge.models.media import MediaPrompts

#: Position-embedding kinds whose cached steps megatron's static inference path computes exactly (``mrope`` given
#: the whole context's positions, see the module docstring).
_CACHEABLE_POSITIONS = ("rope", "learned_absolute", "none", "mrope")


@runtime_checkable
class ComposedDecoder(Protocol):
    """A model that runs a megatron ``GPTModel`` after stages of its own (a VLM's vision tower writing into the
    embeddings) and decodes with that model's KV cache: its forward takes the ``GPTModel``'s ``inference_context``
    and ``runtime_gather_output`` keywords and passes them on, and it runs only its text stages on tokens given
    without media inputs (a cached step)."""

    def kv_cache_decoder(self) -> Any:
        """The ``GPTModel`` whose attention layers hold the cache."""


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits when the output layer is split over tensor-parallel ranks."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        return tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits


def pick(probs: torch.Tensor, uniform: float) -> int:
    """The id an inverse-CDF draw ``uniform`` in [0, 1) picks from ``probs`` (one row, not necessarily normalised).

    Why not ``torch.multinomial``: with the draw explicit, a second computation of the same distribution can replay
    it -- the GRPO sampler drafts replies with the KV cache and verifies every pick against the trainer's forward
    with the same draws (:mod:`loongforge.train.rl.rollout`). A zero-probability id is never picked."""
    cdf = torch.cumsum(probs.double(), dim=0)
    index = int(torch.searchsorted(cdf, uniform * float(cdf[-1]), right=True))
    if index >= probs.numel():  # the draw rounded up to the whole mass: the last id with any
        index = int(torch.nonzero(probs > 0)[-1])
    return index


def uniform_draw(generator: torch.Generator) -> float:
    """One draw in [0, 1) from ``generator``: what :func:`pick` consumes per sampled token."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def _next_token(logits: torch.Tensor, temperature: float, top_k: int, uniform: float, top_p: float = 1.0) -> int:
    """Greedy when ``temperature <= 0``; else sample (by the draw ``uniform``) from the ``top_k`` best, then from the
    smallest set of tokens whose probability reaches ``top_p`` (the most likely token is always kept)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits.float(), dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=0) - sorted_probs  # mass of the strictly better tokens
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return pick(probs, uniform)


def _language_model(model: Any) -> Any:
    """The ``GPTModel`` that ``model`` decodes through: itself, or a composed model's; ``None`` otherwise."""
    from megatron.core.models.gpt import GPTModel

    decoder = model.kv_cache_decoder() if isinstance(model, ComposedDecoder) else model
    return decoder if isinstance(decoder, GPTModel) else None


def supports_kv_cache(model: Any) -> bool:
    """Whether ``model`` decodes through megatron's static inference path (see the module docstring)."""
    decoder = _language_model(model)
    return (decoder is not None and decoder.position_embedding_type in _CACHEABLE_POSITIONS
            and not decoder.config.sequence_parallel
            and all(getattr(module, "supports_kv_cache", True) for module in model.modules()))


def _multi_axis_rope(model: Any) -> bool:
    """Whether ``model`` rotates by M-RoPE's three position axes."""
    decoder = _language_model(model)
    return decoder is not None and decoder.position_embedding_type == "mrope"


def _sequence_parallel_size(model: Any) -> int:
    """The number of ranks a megatron model with sequence parallelism splits the sequence over, else 1."""
    from megatron.core import parallel_state
    from megatron.core.transformer.module import MegatronModule

    if isinstance(model, MegatronModule) and model.config.sequence_parallel:
        return parallel_state.get_tensor_model_parallel_world_size()
    return 1


def _positions(real: torch.Tensor) -> torch.Tensor:
    """Each column's position among its row's real tokens (padding gets its neighbour's, never below 0)."""
    return (real.long().cumsum(dim=1) - 1).clamp(min=0)


def _attention_mask(real: torch.Tensor, queries: int) -> torch.Tensor | None:
    """Megatron's ``[b, 1, queries, keys]`` mask (``True`` = hidden) for the last ``queries`` columns: causal, and
    no padded key is seen except by its own query. ``None`` (plain causal) when nothing is padded."""
    if bool(real.all()):
        return None
    keys = real.shape[1]
    query_index = torch.arange(keys - queries, keys, device=real.device).unsqueeze(1)
    key_index = torch.arange(keys, device=real.device).unsqueeze(0)
    visible = (key_index <= query_index) & (real.unsqueeze(1) | (key_index == query_index))
    return ~visible.unsqueeze(1)


@torch.no_grad()
def sequence_logits(model: Any, rows: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Each row's ``[len(row), padded vocab]`` logits (float32, on the CPU) from one forward of the rows left-padded
    into a batch: what scoring a text needs (``loongforge eval``'s log-likelihoods). The padding is hidden as in
    generation, so a row's logits do not depend on the rows batched with it beyond the last bits. Every
    tensor-parallel rank must call it (the forward is collective)."""
    width = max(len(row) for row in rows)
    multiple = _sequence_parallel_size(model)
    width += -width % multiple
    device = next(model.parameters()).device
    tokens = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    real = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    for index, row in enumerate(rows):
        tokens[index, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
        real[index, width - len(row):] = True
    was_training = model.training
    model.eval()
    try:
        logits = gather_vocab(model(tokens, _positions(real), _attention_mask(real, width))).float().cpu()
    finally:
        model.train(was_training)
    return [logits[index, width - len(row):] for index, row in enumerate(rows)]


class _Context:
    """The growing, left-padded token batch and, while it lasts, the model's KV cache over it."""

    def __init__(self, model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, max_positions: int,
                 use_cache: bool, device: torch.device, media: MediaPrompts | None = None) -> None:
        if media is None:
            prompts = [list(prompt)[-max_positions:] for prompt in prompts]
        elif _sequence_parallel_size(model) > 1:
            raise LoongForgeError("prompts with media are decoded without sequence parallelism")
        elif max(map(len, prompts)) + max_new_tokens > max_positions:
            raise LoongForgeError(f"a prompt of {max(map(len, prompts))} tokens with its media and {max_new_tokens} "
                                  f"new tokens exceed the model's {max_positions} positions: ask for fewer tokens")
        width = max(len(prompt) for prompt in prompts)
        self.tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        self.real = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)
        for row, prompt in enumerate(prompts):
            self.tokens[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            self.real[row, width - len(prompt):] = True
        self.model, self.max_positions, self.prompt_width = model, max_positions, width
        #: Forward inputs of the prompts' media (the prefill's), their positions ``(axes, b, width)`` and offsets.
        self.inputs: dict[str, Any] = {} if media is None else dict(media.inputs)
        self.prompt_positions = None if media is None else _prompt_positions(media, width, device)
        self.offsets = None
        if media is not None and media.position_offsets:
            self.offsets = torch.tensor(media.position_offsets, dtype=torch.long, device=device).unsqueeze(1)
        self.multi_axis = _multi_axis_rope(model)
        #: Sequence parallelism splits the sequence over the tensor-parallel ranks: recomputed contexts are
        #: left-padded (masked) to a multiple of their number.
        self.sequence_multiple = _sequence_parallel_size(model)
        self.cache: Any = None
        self.cached = 0  # columns whose keys and values the cache holds
        if use_cache and supports_kv_cache(model):
            from megatron.core.inference.contexts import StaticInferenceContext

            self.cache = StaticInferenceContext(len(prompts), min(max_positions, width + max_new_tokens))

    def positions(self, real: torch.Tensor) -> torch.Tensor:
        """Position ids of the columns of ``real`` (the whole context, or without media its sliding window):
        ``(b, s)``, or ``(axes, b, s)`` for media prompts with several axes or an M-RoPE model (text: equal axes)."""
        ids = _positions(real)
        if self.offsets is not None:  # tokens after the prompts sit past their media
            after = torch.arange(ids.shape[1], device=ids.device) >= self.prompt_width
            ids = ids + self.offsets * after
        if self.prompt_positions is None and not self.multi_axis:
            return ids
        axes = 3 if self.prompt_positions is None else self.prompt_positions.shape[0]
        ids = ids.unsqueeze(0).repeat(axes, 1, 1)
        if self.prompt_positions is not None:
            ids[:, :, :self.prompt_width] = self.prompt_positions
        return ids

    def last_logits(self) -> torch.Tensor:
        """``[b, padded vocab]`` logits of the token after each row's context."""
        if self.cache is not None and self.tokens.shape[1] > self.cache.max_sequence_length:
            self.cache = None  # the context outgrew the model's positions: recompute a sliding window from here
        if self.cache is None:
            tokens, real = self.tokens[:, -self.max_positions:], self.real[:, -self.max_positions:]
            pad = -tokens.shape[1] % self.sequence_multiple
            positions = F.pad(self.positions(real), (pad, 0))
            tokens, real = F.pad(tokens, (pad, 0)), F.pad(real, (pad, 0))
            logits = self.model(tokens, positions, _attention_mask(real, real.shape[1]), **self.inputs)
            return gather_vocab(logits)[:, -1]
        new = self.tokens.shape[1] - self.cached
        positions = self.positions(self.real)
        logits = self.model(
            self.tokens[:, self.cached:], positions if self.multi_axis else positions[..., self.cached:],
            _attention_mask(self.real, new), inference_context=self.cache, runtime_gather_output=True,
            **(self.inputs if self.cached == 0 else {}),
        )
        self.cache.increment_sequence_len_offset(new)
        self.cached += new
        return logits[:, -1]

    def append(self, column: Sequence[int], real: Sequence[bool]) -> None:
        """One more column: each row's new id, and whether it is real (a stopped row's placeholder is not)."""
        device = self.tokens.device
        self.tokens = torch.cat([self.tokens, torch.tensor(column, device=device).unsqueeze(1)], dim=1)
        self.real = torch.cat([self.real, torch.tensor(real, device=device).unsqueeze(1)], dim=1)


def _prompt_positions(media: MediaPrompts, width: int, device: torch.device) -> torch.Tensor | None:
    """``(axes, b, width)`` position ids of the left-padded prompts from each prompt's own (padding: 0)."""
    if media.positions is None:
        return None
    axes = {int(p.shape[0]) for p in media.positions}
    if len(axes) != 1 or any(p.shape[-1] != len(ids) for p, ids in zip(media.positions, media.ids, strict=True)):
        raise LoongForgeError("media prompts: every prompt's positions must be (axes, its length) with one number of "
                              f"axes, got {[tuple(p.shape) for p in media.positions]}")
    out = torch.zeros(axes.pop(), len(media.ids), width, dtype=torch.long, device=device)
    for row, positions in enumerate(media.positions):
        out[:, row, width - positions.shape[-1]:] = positions.to(device)
    return out


@dataclass
class Sampled:
    """What :func:`sample_batch` wrote for each prompt: the new ``ids`` (a stop id left out), the log-prob of each
    chosen id under the model's whole distribution (the logits' log-softmax over the padded vocabulary, before any
    temperature or top-k; the stop id's last when the prompt stopped) and the stop id it ended at (``None``: it ran
    out of tokens)."""

    ids: list[list[int]]
    logprobs: list[list[float]]
    stops: list[int | None]


@torch.no_grad()
def sample_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    vocab_size: int,
    max_positions: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | Sequence[int] = 0,
    stop_ids: Collection[int] = (),
    use_cache: bool = True,
    on_step: Callable[[int], None] | None = None,
    uniforms: Sequence[Sequence[float]] | None = None,
    media: MediaPrompts | None = None,
) -> Sampled:
    """Extend each prompt by up to ``max_new_tokens`` ids (one number, or one per prompt).

    ``on_step(writing)``, when given, is called after each decoding step with the number of prompts that wrote a
    token in it (a progress display counts the steps with it).

    A prompt stops early at any of ``stop_ids`` (end-of-text, or a chat model's end-of-turn ids).
    ``vocab_size`` is the tokenizer's: ids beyond it (megatron pads the vocabulary) are never chosen. Prompts
    longer than ``max_positions`` keep their last ``max_positions`` ids. ``use_cache=False`` recomputes the whole
    context every token. ``seed`` seeds every prompt's generator, or one seed per prompt; ``uniforms``, when given,
    replaces the generators: the ``k``-th token sampled for prompt ``r`` is picked by the draw ``uniforms[r][k]``.
    ``media``: what a family made of the prompts with media files (:class:`~loongforge.models.media.MediaPrompts`,
    whose ``ids`` are ``prompts``): their forward inputs and positions.
    """
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise LoongForgeError("text generation does not support pipeline parallelism (parallel.pp > 1)")
    if not prompts or any(len(prompt) == 0 for prompt in prompts):
        raise LoongForgeError("text generation needs non-empty prompts")
    seeds = [seed] * len(prompts) if isinstance(seed, int) else list(seed)
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    generators = [torch.Generator(device="cpu").manual_seed(s) for s in seeds]
    was_training = model.training
    model.eval()
    context = _Context(model, prompts, max(limits), max_positions, use_cache, next(model.parameters()).device, media)
    out = Sampled([[] for _ in prompts], [[] for _ in prompts], [None] * len(prompts))
    live = [limit > 0 for limit in limits]
    try:
        for _ in range(max(limits)):
            writing = sum(live)
            full = context.last_logits().float().cpu()
            logits = full[:, :vocab_size]
            column = [0] * len(prompts)  # a stopped prompt's placeholder id (masked out)
            for row, generator in enumerate(generators):
                if live[row]:
                    done = len(out.logprobs[row])
                    if temperature <= 0:  # greedy: no draw
                        draw = 0.0
                    else:
                        draw = uniform_draw(generator) if uniforms is None else float(uniforms[row][done])
                    token = _next_token(logits[row], temperature, top_k, draw, top_p)
                    out.logprobs[row].append(float(torch.log_softmax(full[row], -1)[token]))
                    if token in stop_ids:
                        out.stops[row] = token
                    else:
                        out.ids[row].append(token)
                        column[row] = token
                    live[row] = out.stops[row] is None and len(out.logprobs[row]) < limits[row]
            if on_step is not None:
                on_step(writing)
            if not any(live):
                break
            context.append(column, live)
    finally:
        model.train(was_training)
    return out


def generate_batch(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, **kwargs: Any) -> list[list[int]]:
    """:func:`sample_batch`'s new ids of each prompt, in order (stop ids left out)."""
    return sample_batch(model, prompts, max_new_tokens, **kwargs).ids


def generate_ids(model: Any, prompt_ids: Sequence[int], max_new_tokens: int, **kwargs: Any) -> list[int]:
    """:func:`generate_batch` for one prompt: its new ids."""
    return generate_batch(model, [prompt_ids], max_new_tokens, **kwargs)[0]


def generate_text(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int, **kwargs: Any) -> str:
    """``prompt`` followed by the generated continuation, decoded with ``tokenizer``."""
    new = generate_ids(
        model,
        tokenizer.encode(prompt),
        max_new_tokens,
        vocab_size=tokenizer.vocab_size,
        stop_ids=() if tokenizer.eos_id is None else (tokenizer.eos_id,),
        **kwargs,
    )
    return prompt + tokenizer.decode(new)
