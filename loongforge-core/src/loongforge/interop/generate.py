"""``loongforge generate``: a quick look at what a checkpoint writes, from either checkpoint kind.

A directory with ``config.json`` and no ``manifest.json`` is read as a Hugging Face checkpoint, anything
else as a LoongForge checkpoint (a step directory, a checkpoint root with ``latest``, or a converted one).
The model is built at TP=PP=1 on CPU through its family's ``build_chunk`` (the one builder,
:mod:`loongforge.models.chunks`) and filled by the same loaders conversion uses, so what this prints is what
a converted or trained model computes. Text is encoded with the tokenizer the checkpoint carries
(:mod:`loongforge.checkpoint.carried_tokenizer`) unless ``--tokenizer`` names another; one with more ids than the
model's vocabulary is refused.

All prompts are decoded as one batch with a KV cache (:mod:`loongforge.models.generate`); in chat mode each
prompt is rendered with the tokenizer's chat template (:mod:`loongforge.data.chat_template`) first and only the
reply is the completion. Decoding shows its progress per token position of the batch (:mod:`loongforge.progress`)
on standard error, since standard output is the completions; reading a Hugging Face directory's weights shows
it per tensor. A batch that stops early (every prompt at end-of-text) ends its display short of the total.

Media files (``--image PATH``, ``--video PATH``) go with every prompt. Core reads none of them: the model's family
declares the kinds it reads (:attr:`~loongforge.models.family.ModelFamily.media_kinds`) and makes the prompts ready
(:meth:`~loongforge.models.family.ModelFamily.media_prompts`: placeholders expanded, forward inputs, positions);
a family that declares none is refused in one line naming the model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongforge.errors import InteropError
from loongforge.interop.model_source import ModelSource, open_model_source
from loongforge.progress import job_progress

#: A prompt: text, or (chat mode) a conversation as ``{"role", "content"}`` messages.
Prompt = str | Sequence[dict[str, str]]


@dataclass(frozen=True)
class Completion:
    """One prompt's result: the text the model was given (the rendered template in chat mode), the ids it
    wrote after it and their decoding."""

    prompt: str
    ids: list[int]
    text: str


def _tokenizer(spec: str) -> Any:
    """``spec`` as a run names it: a registered tokenizer kind (``byte``, a plugin's ``byte-vision``) with an
    optional ``:argument``, else a directory holding ``tokenizer.json``."""
    from loongforge.data.tokenizers import load_tokenizer
    from loongforge.plugins import get_host

    kind, _, argument = spec.partition(":")
    registry = get_host().registry("tokenizer")
    if kind not in registry:
        return load_tokenizer(spec)
    factory = registry.load(kind, where="the tokenizer")
    return factory(argument) if argument else factory()


def complete_from_checkpoint(
    path: str | Path,
    prompts: Sequence[Prompt],
    *,
    tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    tokenizer: str | None = None,
    trust_code: bool = False,
    chat: bool = False,
    system: str | None = None,
    ignore_eos: bool = False,
    use_cache: bool = True,
    media: Mapping[str, Sequence[str | Path]] | None = None,
) -> list[Completion]:
    """What the model in ``path`` writes after each prompt, the prompts decoded as one batch with a KV cache
    (:mod:`loongforge.models.generate`; greedy unless ``temperature > 0``).

    ``chat`` renders each prompt with the tokenizer's chat template (:func:`chat_prompt_text`); ``ignore_eos``
    writes all ``tokens`` ids even past the end-of-text id; ``use_cache=False`` recomputes the whole context each
    token. ``trust_code`` lets a ``pkg.module:attr`` model name in a LoongForge checkpoint's config import its module.
    ``media`` maps a kind of file (``image``) to paths given to every prompt, read by the model's family.
    """
    from loongforge.interop.mcore_checkpoint import HF_SOURCE
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone
    from loongforge.models.generate import generate_batch
    from loongforge.models.media import MediaRequest

    if tokens < 0:
        raise InteropError(f"the number of new tokens must be >= 0, got {tokens}")
    if not prompts:
        raise InteropError("generation needs at least one prompt")
    source = open_model_source(path, trust_code=trust_code, command="`loongforge generate`")
    path, family, is_hf = source.path, source.family, source.is_hf
    spec, tok = source_tokenizer(source, tokenizer)
    decoder = family.decoder
    render: Callable[[Prompt], str] = (lambda prompt: chat_prompt_text(tok, prompt, system)) if chat else _plain_prompt
    files = _media_files(source, media or {})
    prepared = None
    if files:
        model_dir = path if is_hf else path / HF_SOURCE
        prepared = family.media_prompts(MediaRequest(prompts, files, render, tok, model_dir if model_dir.is_dir()
                                                     else None))
        texts, encoded = prepared.texts, prepared.ids
    else:
        texts = [render(prompt) for prompt in prompts]
        encoded = [tok.encode(text) for text in texts]
    for number, (text, ids) in enumerate(zip(texts, encoded, strict=True), 1):
        if not ids:
            raise InteropError(f"prompt {number} ({text!r}) has no tokens")
    with standalone_world() as backend:
        # the family's own chunk (a composed model's too), with the trained weights (a LoRA run's adapters merged)
        model = source.load(build_standalone(family, backend, source.dtype))
        # on stderr: stdout carries the completions (a pipe reading --jsonl must get nothing else)
        with job_progress("generating", total=tokens, unit="token", stderr=True) as progress:
            new = generate_batch(
                model, encoded, tokens, vocab_size=tok.vocab_size,
                max_positions=decoder.max_position_embeddings, temperature=temperature, top_k=top_k, top_p=top_p,
                seed=seed, stop_ids=() if ignore_eos else stop_ids(path if is_hf else path / HF_SOURCE, spec, tok),
                use_cache=use_cache, media=prepared,
                on_step=lambda writing: progress.advance(note=f"{writing} of {len(encoded)} prompts writing"),
            )
    return [Completion(text, ids, tok.decode(ids)) for text, ids in zip(texts, new, strict=True)]


def _media_files(source: ModelSource, media: Mapping[str, Sequence[str | Path]]) -> dict[str, list[Path]]:
    """``media`` as existing paths by kind, each kind one the model's family reads (else one line naming the model
    and the kind); kinds without files are left out."""
    from loongforge.resolve import model_label

    files = {kind: [Path(item).expanduser() for item in paths] for kind, paths in media.items() if paths}
    family = source.family
    name = model_label(source.config, family) if source.config is not None else family.family_name
    for kind, paths in files.items():
        if kind not in family.media_kinds:
            reads = ", ".join(family.media_kinds) or "text only"
            raise InteropError(f"{source.path}: model '{name}' takes no {kind} input (it reads {reads})")
        for item in paths:
            if not item.exists():  # a file, or a directory for a family that reads one (frames of a video)
                raise InteropError(f"{kind} file {item} does not exist")
    return files


def source_tokenizer(source: ModelSource, override: str | None = None) -> tuple[str, Any]:
    """``(spec, tokenizer)`` to encode text for the model of ``source``: ``override`` (a ``--tokenizer``) or the one
    the checkpoint carries, refused in one line when it is missing or has more ids than the model."""
    spec = override or source.tokenizer()  # the carried one is checked against config.yaml only when it is used
    if spec is None:
        raise InteropError(f"{source.path}: carries no tokenizer (no tokenizer.json or loongforge_tokenizer.json); "
                           "pass --tokenizer (byte or hf:/dir)")
    tok = _tokenizer(spec)
    if tok.vocab_size > source.family.decoder.vocab_size:
        raise InteropError(f"tokenizer {tok.name} has {tok.vocab_size} ids but the model in {source.path} only "
                           f"{source.family.decoder.vocab_size}; pass --tokenizer with this model's tokenizer")
    return spec, tok


def generate_from_checkpoint(path: str | Path, prompt: str, **options: Any) -> str:
    """``prompt`` and its continuation by the model in ``path``; ``options`` as :func:`complete_from_checkpoint`'s."""
    (completion,) = complete_from_checkpoint(path, [prompt], **options)
    return completion.prompt + completion.text


def stop_ids(model_dir: Path, tokenizer_spec: str, tokenizer: Any) -> frozenset[int]:
    """The ids that end a continuation: the tokenizer's end-of-text id plus every ``eos_token_id`` (an id or a list:
    chat models list their end-of-turn token there, e.g. Llama-3-instruct's ``<|eot_id|>``) of the
    ``generation_config.json`` beside the model (an HF directory, a converted checkpoint's ``hf_source/``) or in the
    tokenizer's directory (``hf:DIR``). Ids outside the tokenizer's vocabulary can never be generated and are left
    out; an unreadable file is a one-line error naming it."""
    from loongforge.interop.hf_checkpoint import GENERATION_FILES

    ids = set() if tokenizer.eos_id is None else {tokenizer.eos_id}
    tokenizer_dir = Path(tokenizer_spec[3:]).expanduser() if tokenizer_spec.startswith("hf:") else None
    for directory in dict.fromkeys(d for d in (model_dir, tokenizer_dir) if d is not None):
        config_path = directory / GENERATION_FILES[0]
        if not config_path.is_file():
            continue
        try:
            listed = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as exc:
            raise InteropError(f"{config_path}: not a generation config ({exc})") from None
        listed = [listed] if isinstance(listed, int) else listed or []
        if not isinstance(listed, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in listed):
            raise InteropError(f"{config_path}: eos_token_id must be an id or a list of ids, got {listed!r}")
        ids.update(i for i in listed if 0 <= i < tokenizer.vocab_size)
    return frozenset(ids)


def _plain_prompt(prompt: Prompt) -> str:
    if not isinstance(prompt, str):
        raise InteropError("a prompt given as chat messages needs chat mode (--chat)")
    return prompt


def chat_prompt_text(tokenizer: Any, prompt: Prompt, system: str | None = None) -> str:
    """``prompt`` (a user message, or a whole conversation as messages) rendered with the chat template of
    ``tokenizer`` (:func:`loongforge.data.chat_template.chat_template_for`: a Hugging Face tokenizer's own, ours for
    ``byte``), ending where the assistant's reply begins; ``system`` leads as a system message."""
    from loongforge.data.chat_template import chat_template_for

    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return chat_template_for(tokenizer).render(messages, add_generation_prompt=True)


def read_prompts(path: str | Path) -> list[Prompt]:
    """The prompts in ``path``: in a ``.jsonl`` file one per line, a JSON string, ``{"prompt": text}`` or
    ``{"messages": [{"role", "content"}, ...]}`` (a conversation, for chat mode); in any other file each
    non-blank line is one prompt."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InteropError(f"cannot read the prompts file {path}: {exc}") from None
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if path.suffix != ".jsonl":
        prompts: list[Prompt] = [line for _, line in numbered]
    else:
        prompts = [_json_prompt(line, f"{path}:{number}") for number, line in numbered]
    if not prompts:
        raise InteropError(f"the prompts file {path} holds no prompt")
    return prompts


def _json_prompt(line: str, where: str) -> Prompt:
    try:
        entry = json.loads(line)
    except ValueError as exc:
        raise InteropError(f"{where}: not JSON ({exc})") from None
    if isinstance(entry, dict) and set(entry) == {"prompt"}:
        entry = entry["prompt"]
    if isinstance(entry, str):
        return entry
    messages = entry.get("messages") if isinstance(entry, dict) and set(entry) == {"messages"} else None
    if (isinstance(messages, list) and messages
            and all(isinstance(m, dict) and set(m) == {"role", "content"}
                    and all(isinstance(v, str) for v in m.values()) for m in messages)):
        return messages
    raise InteropError(f'{where}: expected a JSON string, {{"prompt": "..."}} or {{"messages": [{{"role": "...", '
                       '"content": "..."}, ...]}')
