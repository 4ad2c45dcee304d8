"""Hugging Face checkpoint directories on disk: the tensor files in, the tensor files out.

Reading uses safetensors (``model.safetensors`` or shards listed by ``model.safetensors.index.json``) and
falls back to ``pytorch_model.bin`` files loaded with ``torch.load(weights_only=True)``, which refuses
pickled code. Tensor names, shapes and dtypes are checked against what ``config.json`` implies *before* any
weight is read, so a wrong checkpoint fails in a second with the tensor and file named.

Writing produces what ``save_pretrained`` produces: one ``model.safetensors``, or numbered shards plus an
index when the tensors exceed the shard size, then ``config.json``, the generation files carried over and the
tokenizer the weights were trained with (:mod:`loongforge.checkpoint.carried_tokenizer`).
Everything goes to a temporary sibling directory that is renamed into place, so a failed write leaves
nothing behind. Reading shows progress per tensor and writing (when asked) per file (:mod:`loongforge.progress`),
with the tensor or file name as the note -- a 70B checkpoint takes minutes either way -- on standard error, because
standard output is what the command produces (``loongforge generate``'s completions, ``convert``'s summary line).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loongforge.checkpoint.carried_tokenizer import DESCRIPTOR, TOKENIZER_FILES, write_tokenizer
from loongforge.errors import InteropError
from loongforge.models.family import ModelFamily
from loongforge.progress import job_progress

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
#: Files besides weights, config.json and the tokenizer that a converted directory keeps.
GENERATION_FILES = ("generation_config.json",)
#: transformers' processor settings (a vision model's image sizes and normalisation), read by a family that takes
#: media files (``loongforge generate --image``) and by transformers' ``AutoProcessor`` after an export.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
#: Everything a converted directory keeps from its source: the tokenizer (files or descriptor), generation and
#: processor files.
CARRIED_FILES = (*TOKENIZER_FILES, DESCRIPTOR, *GENERATION_FILES, *PROCESSOR_FILES)
#: Buffers some older checkpoints saved (RoPE frequencies, GPT-2's causal-mask ``attn.bias``/``attn.masked_bias``);
#: recomputed from config.json, never weights.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
_SAFETENSORS_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
_TORCH_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor of a Hugging Face checkpoint lives, and its shape and dtype (fp32/bf16/fp16/other)."""

    file: Path
    shape: tuple[int, ...]
    dtype: str


def index_weight_files(index: Path) -> dict[str, Path]:
    """Tensor name -> file, from a sharded checkpoint's index (``*.index.json``), every listed file present."""
    directory = index.parent
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InteropError(f"{index}: cannot read its weight_map: {exc}") from None
    files = {name: directory / file for name, file in weight_map.items()}
    for file in sorted(set(files.values())):
        if not file.is_file():
            raise InteropError(f"{index}: lists {file.name}, which is missing")
    return files


def _safetensors_infos(files: list[Path]) -> dict[str, TensorInfo]:
    infos = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    piece = handle.get_slice(name)
                    infos[name] = TensorInfo(file, tuple(piece.get_shape()),
                                             _SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype()))
        except Exception as exc:  # noqa: BLE001 - safetensors' SafetensorError derives from Exception only
            raise InteropError(f"{file}: not a readable safetensors file: {exc}") from None
    return infos


def _bin_load(file: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - unpickling errors have many types
        raise InteropError(f"{file}: cannot load with torch.load(weights_only=True): {exc}") from None


def index_hf_tensors(directory: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint in ``directory`` with its file, shape and dtype, reading no weights
    (``.bin`` files are memory-mapped)."""
    directory = Path(directory).expanduser()
    if (directory / SAFETENSORS_INDEX).is_file():
        files = index_weight_files(directory / SAFETENSORS_INDEX)
        infos = _safetensors_infos(sorted(set(files.values())))
    elif (directory / SAFETENSORS).is_file():
        infos = _safetensors_infos([directory / SAFETENSORS])
    elif (directory / BIN_INDEX).is_file() or (directory / BIN).is_file():
        bins = sorted(set(index_weight_files(directory / BIN_INDEX).values())) if (directory / BIN_INDEX).is_file() \
            else [directory / BIN]
        infos = {
            name: TensorInfo(file, tuple(t.shape), _TORCH_DTYPES.get(t.dtype, str(t.dtype)))
            for file in bins for name, t in _bin_load(file).items()
        }
    else:
        raise InteropError(f"{directory}: no {SAFETENSORS}, {SAFETENSORS_INDEX}, {BIN} or {BIN_INDEX}")
    return {name: info for name, info in infos.items() if not name.endswith(_IGNORED_SUFFIXES)}


def check_hf_tensors(infos: dict[str, TensorInfo], model: ModelFamily, directory: str | Path) -> str:
    """Refuse missing, unexpected or misshapen tensors and mixed dtypes; return the one dtype (fp32/bf16/fp16).

    What the directory must hold is the model's adapter's :meth:`~loongforge.models.family.HFAdapter.tensor_shapes`
    (tensors it may hold and ignores have no shape there), so a plugin family's checkpoints are checked as core's.
    """
    adapter = model.hf_adapter()
    if adapter is None:
        raise InteropError(f"{directory}: model {model.family_name} has no Hugging Face adapter to read tensors with")
    expected = adapter.tensor_shapes(list(infos))
    required = {name: shape for name, shape in expected.items() if shape is not None}
    missing = sorted(set(required) - set(infos))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InteropError(f"{directory}: tensor {missing[0]} is missing{more}; config.json implies it")
    extra = sorted(set(infos) - set(expected))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise InteropError(
            f"{infos[extra[0]].file}: unexpected tensor {extra[0]}{more} for a {model.family_name} model as "
            "config.json describes it"
        )
    for name, shape in required.items():
        if infos[name].shape != shape:
            raise InteropError(
                f"{infos[name].file}: tensor {name} has shape {list(infos[name].shape)}, "
                f"config.json implies {list(shape)}"
            )
    first_name = next(iter(required))  # the adapter's first tensor (a decoder's: the embedding)
    first = infos[first_name].dtype
    if first not in _SAFETENSORS_DTYPES.values():
        raise InteropError(f"{directory}: tensor dtype {first} is not supported (use float32, bfloat16 or float16)")
    odd = next((name for name in sorted(required) if infos[name].dtype != first), None)
    if odd is not None:
        raise InteropError(
            f"{infos[odd].file}: tensor {odd} is {infos[odd].dtype} but {first_name} is {first}; "
            "mixed dtypes are not supported"
        )
    return first


def _read_tensors(file: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of each of ``names`` stored in ``file``, one at a time (safetensors reads only those)."""
    if file.suffix == ".safetensors":
        with safe_open(str(file), framework="pt") as handle:
            for name in names:
                yield name, handle.get_tensor(name)
    else:
        loaded = _bin_load(file)
        for name in names:
            yield name, loaded[name]


def load_hf_tensors(infos: dict[str, TensorInfo], names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``infos`` lists (or only ``names``), read file by file with a progress display per tensor."""
    wanted = set(infos) if names is None else names
    by_file: dict[Path, list[str]] = {}
    for name in sorted(wanted):
        by_file.setdefault(infos[name].file, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    with job_progress("reading Hugging Face tensors", total=len(wanted), unit="tensor", stderr=True) as progress:
        for file, file_names in sorted(by_file.items()):
            for name, tensor in _read_tensors(file, file_names):
                tensors[name] = tensor
                progress.advance(note=name)
    return tensors


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5 * 10**9 and ``"2GiB"`` -> 2 * 2**30 (Hugging Face's ``max_shard_size`` convention)."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    unit = next((u for u in units if upper.endswith(u)), None)
    number, factor = (upper[: -len(unit)], units[unit]) if unit else (upper, 1)
    try:
        return int(float(number) * factor)
    except ValueError:
        raise InteropError(f"invalid size {text!r}; use e.g. 5GB, 500MB or 2GiB") from None


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in name order, packed greedily into shards of at most ``max_bytes`` (a bigger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def prepare_out(out_dir: Path) -> Path:
    """A fresh temporary sibling of ``out_dir``; ``out_dir`` itself must be absent or empty."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InteropError(f"{out_dir}: already exists and is not empty; choose a new output directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".tmp-{out_dir.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish(tmp: Path, out_dir: Path) -> None:
    """Make a fully written ``tmp`` visible as ``out_dir`` in one rename."""
    if out_dir.is_dir():
        out_dir.rmdir()  # prepare_out checked it is empty
    os.rename(tmp, out_dir)


@dataclass(frozen=True)
class CarriedFiles:
    """What a Hugging Face export carries besides its weights and ``config.json``: the generation files of
    ``source`` (the directory the weights came from, if any) and the tokenizer ``tokenizer`` names (a ``data.tokenizer``
    value, written by :func:`~loongforge.checkpoint.carried_tokenizer.write_tokenizer`; ``None``: no tokenizer is
    known, so none is written)."""

    source: Path | None
    tokenizer: str | None


def copy_carried_files(source: Path | None, target: Path, names: tuple[str, ...] = CARRIED_FILES) -> list[str]:
    """Copy the files ``names`` (default: tokenizer and generation files) from ``source`` (if any) to ``target``."""
    if source is None or not source.is_dir():
        return []
    copied = []
    for name in names:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
            copied.append(name)
    return copied


def write_hf_checkpoint(
    out_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    *,
    max_shard_bytes: int = 5 * 10**9,
    carry_from: CarriedFiles | None = None,
    progress: bool = False,
) -> Path:
    """Write ``tensors`` and ``config`` (and the generation files and tokenizer ``carry_from`` names) as a HF
    directory; ``progress`` shows it per file (a conversion does; ``checkpoint.save_hf`` inside a training run, which
    has its own display, does not)."""
    out_dir = Path(out_dir).expanduser()
    tmp = prepare_out(out_dir)
    try:
        shards = _shards(tensors, max_shard_bytes)
        names = [SAFETENSORS] if len(shards) == 1 else [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                                        for i in range(1, len(shards) + 1)]
        # one safetensors file is written in one call: the display counts its tensors once it is on disk
        with job_progress("writing Hugging Face tensors", total=len(tensors), unit="tensor",
                          stderr=True) if progress else nullcontext() as shown:
            for name, shard in zip(names, shards, strict=True):
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                if shown is not None:
                    shown.advance(len(shard), note=name)
        if len(shards) > 1:
            weight_map = {tensor: name for name, shard in zip(names, shards, strict=True) for tensor in shard}
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        if carry_from is not None:
            copy_carried_files(carry_from.source, tmp, GENERATION_FILES)
            if carry_from.tokenizer:
                write_tokenizer(carry_from.tokenizer, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
