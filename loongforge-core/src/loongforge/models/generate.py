"""Text generation from a megatron ``GPTModel``: greedy, or temperature + top-k / top-p (nucleus) sampling.

No KV cache on purpose: generation here is a smoke test of a trained model (the quickstart sample and
``loongforge generate``), and re-running the full context each token keeps this to one forward call that
works for every model family. The context is truncated to the model's maximum positions.

Every tensor-parallel rank must call :func:`generate` (the forward pass is collective); pipeline
parallelism is not supported here. Sampling draws from a private generator, so it never perturbs the
training RNG streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from loongforge.errors import LoongForgeError


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits when the output layer is split over tensor-parallel ranks."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        return tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits


def _next_token(
    logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator, top_p: float = 1.0
) -> int:
    """Greedy when ``temperature <= 0``; else sample from the ``top_k`` best, then from the smallest set of
    tokens whose probability reaches ``top_p`` (the most likely token is always kept)."""
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
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_ids(
    model: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    vocab_size: int,
    max_positions: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_id: int | None = None,
) -> list[int]:
    """Extend ``prompt_ids`` by up to ``max_new_tokens`` ids (stops early at ``stop_id``); returns the new ids.

    ``vocab_size`` is the tokenizer's: ids beyond it (megatron pads the vocabulary) are never sampled.
    """
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise LoongForgeError("text generation does not support pipeline parallelism (parallel.pp > 1)")
    if not prompt_ids:
        raise LoongForgeError("text generation needs a non-empty prompt")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    ids = list(prompt_ids)
    new: list[int] = []
    try:
        for _ in range(max_new_tokens):
            context = ids[-max_positions:]
            tokens = torch.tensor([context], dtype=torch.long, device=device)
            positions = torch.arange(len(context), dtype=torch.long, device=device).unsqueeze(0)
            logits = _gather_vocab(model(tokens, positions, None))
            last = logits[0, -1, :vocab_size].float().cpu()
            token = _next_token(last, temperature, top_k, generator, top_p)
            if token == stop_id:
                break
            ids.append(token)
            new.append(token)
    finally:
        model.train(was_training)
    return new


def generate_text(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int, **kwargs: Any) -> str:
    """``prompt`` followed by the generated continuation, decoded with ``tokenizer``."""
    new = generate_ids(
        model,
        tokenizer.encode(prompt),
        max_new_tokens,
        vocab_size=tokenizer.vocab_size,
        stop_id=tokenizer.eos_id,
        **kwargs,
    )
    return prompt + tokenizer.decode(new)
