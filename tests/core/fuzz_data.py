"""Malformed data sets, each written next to a small config that trains on it, with the text its error must name.

Three families of core's data, each broken one way at a time from a valid original:

- **indexed** (``data.dataset: mmap``): a Megatron-LM ``.bin`` / ``.idx`` pair with our ``.loongforge.json``
  sidecar, written by :class:`~loongforge.data.indexed.TokenDatasetWriter` -- sidecar keys missing or of the wrong
  type, an ``.idx`` with a bad header, counts or offsets, files truncated or missing, token ids past the vocabulary
  (in a small file, read whole, at the end of one large enough to be sampled, and in a foreign dataset with no
  sidecar), a dataset too short for one sample;
- **text corpora** (``data.dataset: text``): ``.txt`` / ``.jsonl`` files with bad JSON, a missing text field, bytes
  that are not UTF-8, nothing in them;
- **chat** (``data.dataset: sft``, ``training.phase: sft``): conversations with bad JSON, missing or unknown roles,
  no reply to learn from.

The LeRobot datasets of the embodied plugin are broken by that plugin's own fault catalogue
(``tests/embodied/lerobot_faults.py``) and by a dropped frame in each layout (:func:`lerobot_cases`), run through the
embodied recipe. The plugins' other data -- diffusion files and latent caches, VLM image-text sources, LeRobot sets
that read cleanly but cannot train the flavor -- is broken in :mod:`fuzz_plugin_data`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from fuzz_harness import Case
from loongforge.data.indexed import TokenDatasetWriter, dataset_files
from loongforge.data.tokenizers import ByteTokenizer

ROOT = Path(__file__).resolve().parents[2]
#: The tiny model every core case trains: llama-tiny has 384 embedding rows, the byte tokenizer 259 ids.
MODEL_VOCAB, BYTE_VOCAB = 384, ByteTokenizer.vocab_size
SEQ = 64
_TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
#: Documents of the valid indexed set: about 4,000 byte tokens, sixty samples of SEQ.
DOCUMENTS = [(_TEXT * 4)[i:] for i in range(10)]


@dataclass(frozen=True)
class DataFault:
    """``make(directory)`` writes the broken data under ``directory`` and returns the ``data:`` section naming it;
    ``expect(directory)`` is the text (a file, a line) the one-line error must contain."""

    name: str
    make: Callable[[Path], dict[str, Any]]
    expect: Callable[[Path], tuple[str, ...]]
    phase: str = "pretrain"


FAULTS: list[DataFault] = []


def _fault(name: str, expect: Callable[[Path], tuple[str, ...]], phase: str = "pretrain") -> Callable:
    def register(make: Callable[[Path], dict[str, Any]]) -> Callable:
        FAULTS.append(DataFault(name, make, expect, phase))
        return make

    return register


# -- indexed token datasets ------------------------------------------------------------------------------------------
def write_indexed(prefix: Path, documents: list[list[int]] | None = None, *, vocab_size: int = BYTE_VOCAB,
                  tokenizer_name: str = "byte") -> Path:
    """A valid dataset at ``prefix`` (the byte tokenizer's ids of :data:`DOCUMENTS` unless ``documents``)."""
    tokenizer = ByteTokenizer()
    documents = documents if documents is not None else [tokenizer.encode(d) for d in DOCUMENTS]
    with TokenDatasetWriter(prefix, vocab_size=vocab_size, tokenizer_name=tokenizer_name,
                            eos_id=tokenizer.eos_id) as writer:
        for ids in documents:
            writer.add_document(ids)
    return prefix


def _mmap(prefix: Path) -> dict[str, Any]:
    return {"dataset": "mmap", "paths": [str(prefix)]}


def _indexed_fault(name: str, file: str, edit: Callable[[Path], None], say: str = "") -> None:
    """A fault in one file of a valid dataset (``file``: ``bin``, ``idx`` or ``sidecar``); the error names that file
    and ``say``."""
    which = {"bin": 0, "idx": 1, "sidecar": 2}[file]

    def make(directory: Path) -> dict[str, Any]:
        prefix = write_indexed(directory / "tokens")
        edit(dataset_files(prefix)[which])
        return _mmap(prefix)

    FAULTS.append(DataFault(f"indexed:{name}", make,
                            lambda d: (str(dataset_files(d / "tokens")[which]), *((say,) if say else ()))))


def _sidecar(edit: Callable[[dict], Any]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        sidecar = json.loads(path.read_text())
        edit(sidecar)
        path.write_text(json.dumps(sidecar))

    return apply


def _patch(offset: int, data: bytes) -> Callable[[Path], None]:
    """Overwrite ``data`` at byte ``offset`` (negative: from the end) of a file."""
    def apply(path: Path) -> None:
        raw = bytearray(path.read_bytes())
        start = offset % len(raw)
        raw[start : start + len(data)] = data
        path.write_bytes(bytes(raw))

    return apply


for _key in ("eos_id", "vocab_size", "tokenizer", "format"):
    _indexed_fault(f"sidecar-without-{_key}", "sidecar", _sidecar(lambda h, k=_key: h.pop(k)), f"'{_key}'"
                   if _key != "format" else "")
for _key, _value in (("eos_id", "257"), ("eos_id", 999), ("eos_id", -1), ("vocab_size", True), ("vocab_size", 0),
                     ("version", 1), ("tokenizer", ["byte"])):
    _indexed_fault(f"sidecar-{_key}={_value}", "sidecar", _sidecar(lambda h, k=_key, v=_value: h.update({k: v})),
                   f"'{_key}'" if _key != "version" else "version")
_indexed_fault("sidecar-not-json", "sidecar", lambda p: p.write_text(p.read_text()[:40]), "unreadable")
_indexed_fault("sidecar-not-utf8", "sidecar", lambda p: p.write_bytes(b'{"format": "\xff\xfe"}'), "unreadable")
_indexed_fault("sidecar-a-list", "sidecar", lambda p: p.write_text("[1, 2, 3]"), "sidecar")
_indexed_fault("sidecar-nested-deep", "sidecar", lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "unreadable")
_indexed_fault("idx-bad-magic", "idx", _patch(0, b"NOTMEGA"), "bad header")
_indexed_fault("idx-version-2", "idx", _patch(9, struct.pack("<Q", 2)), "version 2")
_indexed_fault("idx-dtype-code-99", "idx", _patch(17, b"\x63"), "dtype code 99")
_indexed_fault("idx-dtype-float64", "idx", _patch(17, b"\x06"), "float64")
_indexed_fault("idx-truncated", "idx", lambda p: p.write_bytes(p.read_bytes()[:60]), "truncated")
_indexed_fault("idx-header-only", "idx", lambda p: p.write_bytes(p.read_bytes()[:20]), "bad header")
_indexed_fault("idx-longer", "idx", lambda p: p.write_bytes(p.read_bytes() + b"\0" * 8), "truncated or damaged")
_indexed_fault("idx-documents-past-the-end", "idx", _patch(-8, struct.pack("<q", 99)), "sequence 0 to 10")
_indexed_fault("idx-documents-unordered", "idx", _patch(-16, struct.pack("<q", 11)), "document index")
_indexed_fault("idx-offsets-gap", "idx", _patch(34 + 4 * len(DOCUMENTS) + 8, struct.pack("<q", 3)), "contiguous")
_indexed_fault("idx-negative-length", "idx", _patch(34, struct.pack("<i", -5)), "negative length")
_indexed_fault("bin-truncated", "bin", lambda p: p.write_bytes(p.read_bytes()[:1000]), "1000 bytes")
_indexed_fault("bin-longer", "bin", lambda p: p.write_bytes(p.read_bytes() + b"\0\0"), "bytes")
_indexed_fault("bin-missing", "bin", lambda p: p.unlink(), "missing")
_indexed_fault("bin-a-directory", "bin", lambda p: (p.unlink(), p.mkdir()), "missing")
_indexed_fault("bin-empty", "bin", lambda p: p.write_bytes(b""), "empty")


def _poke(offset: int, value: int) -> Callable[[Path], None]:
    """Write token ``value`` at ``offset`` (negative: from the end) of a uint16 ``.bin``."""
    def apply(path: Path) -> None:
        tokens = np.memmap(path, dtype="<u2", mode="r+")
        tokens[offset] = value
        tokens.flush()
        del tokens

    return apply


_indexed_fault("id-past-model-vocab", "bin", _poke(1234, 60000), "token id 60000 at token 1234")
_indexed_fault("id-past-tokenizer-vocab", "bin", _poke(-2, 300), "token id 300")


@_fault("indexed:id-past-vocab-sampled", lambda d: (str(dataset_files(d / "big")[0]), "token id 1000", "384 ids"))
def _(directory: Path) -> dict[str, Any]:
    """Large enough (~10 MB) for the id check to sample: the bad id is the last token, in the last block read."""
    rows = np.tile(np.arange(1, 250, dtype=np.int64), 20_000)
    prefix = write_indexed(directory / "big", [rows[: len(rows) // 2], rows[len(rows) // 2:]])
    _poke(-1, 1000)(dataset_files(prefix)[0])
    return _mmap(prefix)


@_fault("indexed:negative-id-int32", lambda d: (str(dataset_files(d / "wide")[0]), "token id -7"))
def _(directory: Path) -> dict[str, Any]:
    prefix = write_indexed(directory / "wide", vocab_size=70_000, tokenizer_name="byte")
    path = dataset_files(prefix)[0]
    tokens = np.memmap(path, dtype="<i4", mode="r+")
    tokens[10] = -7
    tokens.flush()
    return _mmap(prefix)


@_fault("indexed:foreign-id-past-tokenizer-vocab", lambda d: (str(dataset_files(d / "foreign")[0]), "token id 300",
                                                            "tokenizer 'byte': 259 ids"))
def _(directory: Path) -> dict[str, Any]:
    """Megatron-LM's own files (no sidecar) are checked by their ids alone."""
    prefix = write_indexed(directory / "foreign")
    dataset_files(prefix)[2].unlink()
    _poke(7, 300)(dataset_files(prefix)[0])
    return _mmap(prefix)


@_fault("indexed:too-short", lambda d: (str(d / "short"), "no training samples"))
def _(directory: Path) -> dict[str, Any]:
    return _mmap(write_indexed(directory / "short", [[72, 105]]))


@_fault("indexed:other-tokenizer", lambda d: (str(d / "other"), "tokenizer 'hf-other'"))
def _(directory: Path) -> dict[str, Any]:
    return _mmap(write_indexed(directory / "other", tokenizer_name="hf-other"))


@_fault("indexed:two-prefixes", lambda d: ("exactly one path prefix",))
def _(directory: Path) -> dict[str, Any]:
    return {"dataset": "mmap", "paths": [str(write_indexed(directory / "a")), str(write_indexed(directory / "b"))]}


# -- raw text corpora ------------------------------------------------------------------------------------------------
def _corpus(name: str, filename: str, content: bytes | Callable[[Path], None], say: Callable[[Path], str]) -> None:
    def make(directory: Path) -> dict[str, Any]:
        path = directory / filename
        if callable(content):
            content(path)
        else:
            path.write_bytes(content)
        return {"dataset": "text", "paths": [str(path)]}

    FAULTS.append(DataFault(f"text:{name}", make, lambda d: (say(d),)))


_GOOD_LINE = json.dumps({"text": _TEXT * 3}).encode() + b"\n"
_corpus("bad-json-line-3", "c.jsonl", _GOOD_LINE * 2 + b'{"text": "unterminated\n', lambda d: f"{d / 'c.jsonl'}:3:")
_corpus("no-text-field", "c.jsonl", _GOOD_LINE + b'{"body": "x"}\n', lambda d: f"{d / 'c.jsonl'}:2:")
_corpus("text-not-string", "c.jsonl", _GOOD_LINE + b'{"text": 42}\n', lambda d: f"{d / 'c.jsonl'}:2:")
_corpus("line-an-array", "c.jsonl", b'["text", "x"]\n', lambda d: f"{d / 'c.jsonl'}:1:")
_corpus("not-utf8-line-2", "c.jsonl", _GOOD_LINE + b'{"text": "caf\xe9"}\n', lambda d: f"{d / 'c.jsonl'}:2:")
_corpus("nested-deep", "c.jsonl", b"[" * 100_000 + b"]" * 100_000 + b"\n", lambda d: f"{d / 'c.jsonl'}:1:")
_corpus("txt-not-utf8", "c.txt", b"Emma Woodhouse, handsome, clever, and rich\xff\n", lambda d: str(d / "c.txt"))
_corpus("txt-empty", "c.txt", b"", lambda d: str(d / "c.txt"))
_corpus("jsonl-blank-lines", "c.jsonl", b"\n\n  \n", lambda d: str(d / "c.jsonl"))
_corpus("csv-suffix", "c.csv", b"text\nhello\n", lambda d: str(d / "c.csv"))
_corpus("too-short", "c.txt", b"Hi.", lambda d: "no training samples")
_corpus("a-directory", "c.txt", lambda p: p.mkdir(), lambda d: str(d / "c.txt"))


# -- chat (SFT) files ------------------------------------------------------------------------------------------------
def _turn(role: str, content: Any) -> dict[str, Any]:
    return {"role": role, "content": content}


_GOOD_CHAT = json.dumps({"messages": [_turn("user", "What is 2+2?"), _turn("assistant", "4")]}).encode() + b"\n"


def _chat(name: str, content: bytes, line: int | None) -> None:
    def make(directory: Path) -> dict[str, Any]:
        (directory / "chat.jsonl").write_bytes(content)
        return {"dataset": "sft", "paths": [str(directory / "chat.jsonl")]}

    FAULTS.append(DataFault(f"chat:{name}", make,
                            lambda d: (f"{d / 'chat.jsonl'}{f':{line}:' if line else ''}",), phase="sft"))


def _record(record: Any) -> bytes:
    return json.dumps(record).encode() + b"\n"


_chat("bad-json-line-2", _GOOD_CHAT + b'{"messages": [\n', 2)
_chat("missing-role", _GOOD_CHAT * 2 + _record({"messages": [{"content": "hi"}, _turn("assistant", "x")]}), 3)
_chat("unknown-role", _record({"messages": [_turn("bot", "hi"), _turn("assistant", "x")]}), 1)
_chat("content-not-string", _GOOD_CHAT + _record({"messages": [_turn("user", ["hi"]), _turn("assistant", "x")]}), 2)
_chat("no-assistant", _record({"messages": [_turn("user", "hi"), _turn("system", "be brief")]}), 1)
_chat("no-messages", _record({"conversation": []}), 1)
_chat("messages-empty", _record({"messages": []}), 1)
_chat("messages-a-string", _record({"messages": "user: hi"}), 1)
_chat("not-utf8", _GOOD_CHAT + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n', 2)
_chat("empty-file", b"", None)
_chat("reply-past-seq-length", _record({"messages": [_turn("user", "x" * 200), _turn("assistant", "ok")]}), None)


def _write_config(path: Path, data: dict[str, Any], phase: str) -> Path:
    """The config every core case trains with: llama-tiny, one step of two samples of :data:`SEQ` tokens."""
    config = {"model": "llama-tiny", "run": {"output_dir": "out"}, "data": {**data, "seq_length": SEQ},
              "training": {"steps": 1, "micro_batch_size": 2, "phase": phase}, "logging": {"progress": False}}
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def data_cases(directory: Path) -> list[Case]:
    """Every core fault written under ``directory`` (one folder each) with its config, as cases."""
    cases = []
    for index, fault in enumerate(FAULTS):
        workdir = directory / f"{index:03d}"
        workdir.mkdir(parents=True)
        path = _write_config(workdir / "run.yaml", fault.make(workdir), fault.phase)
        cases.append(Case(fault.name, (str(path),), workdir, (str(path), *fault.expect(workdir))))
    return cases


def valid_data_cases(directory: Path) -> list[Case]:
    """The originals the faults are made from, in the same configs: each must pass ``check``."""
    directory.mkdir(parents=True)
    corpus, chat = directory / "c.jsonl", directory / "chat.jsonl"
    corpus.write_bytes(_GOOD_LINE * 40)
    chat.write_bytes(_GOOD_CHAT * 8)
    originals = {"indexed": (_mmap(write_indexed(directory / "tokens")), "pretrain"),
                 "text": ({"dataset": "text", "paths": [str(corpus)]}, "pretrain"),
                 "chat": ({"dataset": "sft", "paths": [str(chat)]}, "sft")}
    return [Case(f"valid:{name}", (str(_write_config(directory / f"{name}.yaml", data, phase)),), directory)
            for name, (data, phase) in originals.items()]


def lerobot_cases(directory: Path) -> list[Case]:
    """LeRobot datasets broken as the embodied plugin documents its reader refusing them (one line naming the file
    and the episode): its own fault catalogue plus :func:`_dropped_frame`, run through its recipe by ``check`` and
    a one-step ``train``; none when the plugin is not installed."""
    if importlib.util.find_spec("loongforge_embodied") is None:
        return []
    catalogue = str(ROOT / "tests" / "embodied")
    if catalogue not in sys.path:  # where pytest puts it when it collects tests/embodied
        sys.path.append(catalogue)
    faults = importlib.import_module("lerobot_faults")
    made = [(f"lerobot:{fault.name}", fault.make, fault.expected) for fault in faults.FAULTS]
    made += [(f"lerobot:dropped-frame-{version}", partial(_dropped_frame, version=version), expected)
             for version, expected in (("v3.0", "data/chunk-000/file-000.parquet: episode 0, frame 5: timestamp"),
                                       ("v2.1", "data/chunk-000/episode_000000.parquet: episode 0, frame 5: "
                                                "timestamp"))]
    cases = []
    for index, (name, make, expected) in enumerate(made):
        workdir = directory / f"{index:03d}"
        workdir.mkdir(parents=True)
        argv = (faults.RECIPE, *faults.run_overrides(make(workdir), workdir / "run"))
        cases.append(Case(name, argv, workdir, (expected,), before_model=False))
    return cases


def _dropped_frame(directory: Path, *, version: str) -> Path:
    """The tiny synthetic LeRobot set with frame 5 of episode 0 stamped as if the frame before it had been dropped
    (its timestamp 0.3 s late at 10 fps)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from loongforge_embodied.data.synthetic import write_synthetic_dataset

    root, _ = write_synthetic_dataset(directory / "dataset", version=version)
    path = root / ("data/chunk-000/file-000.parquet" if version == "v3.0" else "data/chunk-000/episode_000000.parquet")
    table = pq.read_table(path)
    stamps = table.column("timestamp").to_pylist()
    stamps[5] += 0.3
    column = pa.array(stamps, type=table.schema.field("timestamp").type)
    pq.write_table(table.set_column(table.column_names.index("timestamp"), "timestamp", column), path)
    return root
