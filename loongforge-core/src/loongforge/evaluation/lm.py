"""LoongForge's model as an lm-evaluation-harness language model: the three request types every lm-eval task is made
of, answered by the megatron model a checkpoint holds.

Why a model class of our own rather than exporting and running lm-eval's ``hf`` class: the checkpoint is scored as it
was trained (any family, a LoRA run's adapters merged, at the tensor-parallel size it is loaded at) without a
conversion step, and generation uses LoongForge's KV-cache decoder. What lm-eval owns it keeps: tokenising a context
and its continuation (:class:`~lm_eval.api.model.TemplateLM`), the rolling windows of a perplexity task, stop
sequences and generation arguments; the scores then equal lm-eval's ``hf`` class on the exported model
(``tests/core/test_lm_eval.py``).

* ``loglikelihood``: the summed log-prob of the continuation after the context, and whether greedy decoding would
  have written it, from one forward of ``(context + continuation)[-(max_length + 1):][:-1]``;
* ``loglikelihood_rolling``: a whole text's log-prob in disjoint windows of the model's positions;
* ``generate_until``: greedy decoding (the KV cache, :mod:`loongforge.models.generate`) until a stop sequence or
  end-of-text, the context cut to leave room for ``max_gen_toks``.

Log-probs are taken over the model's vocabulary (``decoder.vocab_size``, what an exported ``config.json`` holds), not
the rows megatron pads it with. Every tensor-parallel rank runs the same requests (the forwards are collective); lm-eval
sees one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from loongforge.models.generate import generate_batch, sequence_logits

#: A request as lm-eval's ``TemplateLM.loglikelihood`` hands it on: ``((context, continuation), ids, ids)``.
TokenRequest = tuple[tuple[str, str] | None, list[int], list[int]]


class LoongForgeLM(TemplateLM):
    """A built, loaded megatron model and its tokenizer (the :class:`~loongforge.data.tokenizers.Tokenizer`
    protocol) answering lm-eval's requests, ``batch_size`` sequences per forward.

    ``vocab_size`` is the model's vocabulary (log-probs are over it), ``max_length`` its positions, ``stop_ids`` the
    ids that end a generation (end-of-text and a chat model's end-of-turn); ``on_batch(done, total)`` reports
    progress.
    """

    def __init__(self, model: Any, tokenizer: Any, *, vocab_size: int, max_length: int, stop_ids: Sequence[int],
                 batch_size: int = 8, max_gen_toks: int = 256,
                 on_batch: Callable[[str, int, int], None] | None = None) -> None:
        super().__init__()
        self.model, self.tok = model, tokenizer
        self.vocab_size, self._max_length = vocab_size, max_length
        self.stop_ids = frozenset(stop_ids) | {tokenizer.eos_id}
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks
        self.on_batch = on_batch

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: beginning-of-text where the tokenizer has one (as lm-eval's ``hf``
        class does), else end-of-text."""
        return self.tok.eos_id if self.tok.bos_id is None else self.tok.bos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tok.encode(string)

    def _batches(self, items: list[Any], what: str | None, size: int | None = None) -> Any:
        """``items`` in batches, reporting progress as ``what`` after each (``None``: not reported)."""
        size = size or self.batch_size
        for start in range(0, len(items), size):
            yield items[start:start + size]
            if self.on_batch is not None and what is not None:
                self.on_batch(what, min(start + size, len(items)), len(items))

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=True)  # progress is ours (``on_batch``), not a tqdm bar

    def _loglikelihood_tokens(self, requests: list[TokenRequest], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        return self._score(requests, "loglikelihood")

    def _score(self, requests: list[TokenRequest], what: str | None) -> list[tuple[float, bool]]:
        results: list[tuple[float, bool]] = []
        for batch in self._batches(requests, what):
            rows = [(context + continuation)[-(self.max_length + 1):][:-1] for _, context, continuation in batch]
            for (key, _, continuation), logits in zip(batch, sequence_logits(self.model, rows), strict=True):
                logprobs = torch.log_softmax(logits[-len(continuation):, :self.vocab_size], dim=-1)
                target = torch.tensor(continuation, dtype=torch.long)
                answer = (float(logprobs.gather(1, target.unsqueeze(1)).sum()),
                          bool((logprobs.argmax(dim=-1) == target).all()))
                results.append(answer)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        results = []
        for texts in self._batches([request.args[0] for request in requests], "loglikelihood_rolling", 1):
            (text,) = texts
            windows = [make_disjoint_window(window) for window in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            scores = self._score([(None, context, continuation) for context, continuation in windows], None)
            total = sum(logprob for logprob, _ in scores)
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return results

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        eos = self.tok.decode([self.eot_token_id]) or None  # a tokenizer that drops it on decoding adds no stop text
        groups: dict[str, list[tuple[int, str, dict[str, Any]]]] = {}  # requests decoded alike, batched together
        for index, (context, gen_kwargs) in enumerate(request.args for request in requests):
            groups.setdefault(repr(sorted(gen_kwargs.items())), []).append((index, context, dict(gen_kwargs)))
        results: list[str] = [""] * len(requests)
        for group in groups.values():
            for batch in self._batches(group, "generate_until"):
                texts = self._generate([context for _, context, _ in batch], batch[0][2], eos)
                for (index, context, gen_kwargs), text in zip(batch, texts, strict=True):
                    results[index] = text
                    self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return results

    def _generate(self, contexts: list[str], gen_kwargs: dict[str, Any], eos: str | None) -> list[str]:
        """Greedy continuations of ``contexts``, which share ``gen_kwargs``, cut at the first stop sequence."""
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = kwargs.pop("max_gen_toks")
        if kwargs.get("do_sample"):
            raise ValueError("loongforge eval decodes greedily; this task asks for sampling (do_sample: true)")
        room = self.max_length - max_gen_toks
        if room <= 0:
            raise ValueError(f"max_gen_toks {max_gen_toks} leaves no room for a context in the model's "
                             f"{self.max_length} positions")
        prompts = [self.tok_encode(context)[-room:] or [self.prefix_token_id] for context in contexts]
        new = generate_batch(self.model, prompts, max_gen_toks, vocab_size=self.vocab_size,
                             max_positions=self.max_length, stop_ids=self.stop_ids)
        return [postprocess_generated_text(self.tok.decode(ids), stop=until, think_end_token=None) for ids in new]
