"""Tokenizers: a small protocol, a built-in byte-level tokenizer, and Hugging Face tokenizers from disk.

Why a protocol of our own instead of passing Hugging Face objects around: the data pipeline needs only six
things (encode, decode, vocabulary size and three special ids), and the built-in :class:`ByteTokenizer` must
work with no optional dependency installed, so the quickstart runs on a bare ``pip install loongforge-core``.
``name`` identifies the exact vocabulary; token datasets record it so that a dataset is never silently read
with a different tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from loongforge.data.errors import DataError


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and text generation need from a tokenizer."""

    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-255 are the bytes, then ``bos`` (256), ``eos`` (257), ``pad`` (258).

    Needs no vocabulary file and is lossless: ``decode(encode(s)) == s`` for every string. Decoding an
    arbitrary id sequence (e.g. sampled from a half-trained model) cannot fail: invalid UTF-8 becomes U+FFFD.
    """

    name = "byte"
    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        arr = np.asarray(ids, dtype=np.int64).ravel()
        return arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face *fast* tokenizer loaded from a local directory (or a Hub id's cached snapshot).

    Reads ``tokenizer.json`` with the ``tokenizers`` library (much lighter than ``transformers``, which is
    not needed); a directory with a SentencePiece ``tokenizer.model`` and no ``tokenizer.json`` (Llama-2, Mistral,
    Gemma releases) is converted by transformers, as ``AutoTokenizer`` does. The special tokens come from
    ``tokenizer_config.json`` (falling back to ``special_tokens_map.json``), the files ``save_pretrained`` writes.
    ``eos_token`` is required because documents are separated by it; ``bos_token`` is optional and ``pad_token``
    defaults to ``eos_token``. A ``tokenizer.json`` alone (what the ``tokenizers`` library saves) names its end of
    text itself (:func:`declared_eos`).
    """

    def __init__(self, directory: str | Path) -> None:
        from loongforge.hf_dirs import resolve_hub_directory

        directory = resolve_hub_directory(str(directory), what="tokenizer")  # a path, or a Hub id's snapshot
        if not directory.is_dir():
            raise DataError(f"tokenizer directory not found: {directory}")
        tokenizer_file = directory / "tokenizer.json"
        self.directory = directory
        self._specials: list[str] = []
        special = _special_tokens(directory)
        if tokenizer_file.is_file():
            self._tok = _fast_tokenizer(tokenizer_file)
            if "eos_token" not in special:
                special["eos_token"], self._specials = declared_eos(tokenizer_file)
            identity = tokenizer_file.read_bytes()
        elif (directory / "tokenizer.model").is_file():
            self._tok, default_specials = _converted_sentencepiece(directory)
            special = {**default_specials, **special}
            identity = (directory / "tokenizer.model").read_bytes()
        else:
            raise DataError(f"no tokenizer.json or tokenizer.model in {directory} (save the tokenizer with "
                            "save_pretrained)")
        self.eos_id = self._token_id(special.get("eos_token"), "eos_token", required=True)
        self.bos_id = self._token_id(special.get("bos_token"), "bos_token", required=False)
        pad = self._token_id(special.get("pad_token"), "pad_token", required=False)
        self.pad_id = self.eos_id if pad is None else pad
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        digest = hashlib.sha256(identity).hexdigest()[:12]
        self.name = f"hf:{directory.name}@{digest}"

    def _token_id(self, token: str | None, key: str, *, required: bool) -> int | None:
        if token is None:
            if required:
                listed = ", ".join(self._specials) or "none"
                raise DataError(
                    f"no {key} in {self.directory}/tokenizer_config.json (needed to separate documents), and its "
                    f"tokenizer.json declares none (special tokens: {listed}); name one as {key} in "
                    "tokenizer_config.json"
                )
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise DataError(f"{key} {token!r} of {self.directory} is not in its tokenizer.json vocabulary")
        return token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(np.asarray(ids, dtype=np.int64).ravel().tolist(), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.directory)!r})"


#: How the tokenizers people train with spell the end of a text.
END_OF_TEXT = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<|eot_id|>")


def declared_eos(tokenizer_file: Path) -> tuple[str | None, list[str]]:
    """``(end-of-text token, special tokens)`` that a ``tokenizer.json`` declares by itself: the special token its
    post-processor appends after each sequence, else its one special token spelt as an end of text
    (:data:`END_OF_TEXT`); ``None`` when it declares none or several."""
    try:
        raw = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {tokenizer_file}: {exc}") from None
    specials = [token["content"] for token in raw.get("added_tokens") or [] if token.get("special")]
    appended = _appended_special(raw.get("post_processor"))
    if appended is not None:
        return appended, specials
    named = [token for token in specials if token in END_OF_TEXT]
    return (named[0] if len(named) == 1 else None), specials


def _appended_special(processor: dict[str, Any] | None) -> str | None:
    """The special token a ``TemplateProcessing`` post-processor writes after the sequence (``$A </s>``)."""
    if not processor:
        return None
    if processor.get("type") == "Sequence":
        return next(filter(None, map(_appended_special, processor.get("processors") or [])), None)
    single = processor.get("single") or [] if processor.get("type") == "TemplateProcessing" else []
    if single and "SpecialToken" in single[-1] and any("Sequence" in item for item in single):
        return single[-1]["SpecialToken"]["id"]
    return None


def _fast_tokenizer(tokenizer_file: Path) -> Any:
    try:
        from tokenizers import Tokenizer as FastTokenizer
    except ImportError:
        raise DataError("Hugging Face tokenizers need the 'tokenizers' package: pip install 'loongforge-core[hf]'"
                        ) from None
    try:
        return FastTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side raises plain Exception subclasses
        raise DataError(f"cannot load {tokenizer_file}: {exc}") from None


def _converted_sentencepiece(directory: Path) -> tuple[Any, dict[str, str]]:
    """The fast tokenizer transformers' ``AutoTokenizer`` makes of the SentencePiece model ``directory`` holds (its
    own converter, so the ids are those every transformers user gets), and the special tokens that tokenizer class
    declares by default (``tokenizer_config.json`` overrides them)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"{directory} holds a SentencePiece tokenizer.model, which transformers converts: pip install "
                        "'loongforge-core[hf]'") from None
    try:
        converted = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        backend = converted.backend_tokenizer
    except Exception as exc:  # transformers raises many kinds (missing sentencepiece/protobuf, a bad model file)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"cannot load the SentencePiece tokenizer in {directory}: {first}") from None
    specials = {key: value for key in ("bos_token", "eos_token", "pad_token")
                if isinstance(value := getattr(converted, key, None), str)}
    return backend, specials


def _special_tokens(directory: Path) -> dict[str, str]:
    """``{"eos_token": "</s>", ...}`` from the files transformers writes; entries may be AddedToken dicts."""
    found: dict[str, str] = {}
    for filename in ("special_tokens_map.json", "tokenizer_config.json"):  # later files win
        path = directory / filename
        if not path.is_file():
            continue
        try:
            config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read {path}: {exc}") from None
        for key in ("bos_token", "eos_token", "pad_token"):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                found[key] = value
    return found


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` -> :class:`ByteTokenizer`; ``"hf:DIR"`` or an existing directory -> :class:`HFTokenizer`."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("hf:"):
        return HFTokenizer(spec[3:])
    if Path(spec).expanduser().is_dir():
        return HFTokenizer(spec)
    raise DataError(
        f"unknown tokenizer {spec!r}: expected 'byte', 'hf:/path/to/dir' or a directory holding tokenizer.json"
    )
