"""Read a released Wan DiT checkpoint -- diffusers' ``transformer/`` folder or the original Wan-AI release -- into
our parameter names, and infer the :class:`WanFlavor` it was trained as.

A checkpoint is a directory of safetensors files: one file, or shards listed by a ``*.safetensors.index.json``
(``diffusion_pytorch_model.safetensors.index.json`` in both layouts). The naming is detected from the tensor
names, and names, shapes and completeness are checked against the model the shapes imply *before* any weight is
read (the conversion runs on meta tensors first), so a wrong or truncated checkpoint fails fast with the tensor
named. Wan 2.2 A14B ships two such directories, one per expert (``high_noise_model``/``low_noise_model`` in the
original release, ``transformer``/``transformer_2`` in diffusers'); load each one.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loongforge.errors import LoongForgeError
from loongforge.interop.hf_checkpoint import index_weight_files
from safetensors import safe_open
from safetensors.torch import load_file

from loongforge_diffusion.wan.diffusers_adapter import from_diffusers, to_diffusers
from loongforge_diffusion.wan.flavors import TASKS, WanFlavor
from loongforge_diffusion.wan.model import WanModel
from loongforge_diffusion.wan.original_adapter import from_original, to_original

_Converter = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]

#: A tensor name only each layout has, and the converters from that layout to ours and back.
_LAYOUTS: dict[str, tuple[str, _Converter, _Converter]] = {
    "diffusers": ("condition_embedder.time_embedder.linear_1.weight", from_diffusers, to_diffusers),
    "original": ("time_embedding.0.weight", from_original, to_original),
}
#: Every released Wan DiT (1.3B, 5B, 14B) uses attention heads of 128 channels; used when no config says more.
RELEASED_HEAD_DIM = 128
#: The Wan 2.2 VAE's latent channels; only TI2V-5B (per-token timesteps) is trained on that VAE.
WAN22_VAE_CHANNELS = 48
_BLOCK_INDEX = re.compile(r"^blocks\.(\d+)\.")


@dataclass(frozen=True)
class WanCheckpoint:
    """A loaded checkpoint: ``state_dict`` in our names, the ``layout`` it was stored in (``diffusers`` or
    ``original``), and ``fields``, the :class:`WanFlavor` fields its shapes (and ``config.json``) determine."""

    state_dict: dict[str, torch.Tensor]
    layout: str
    fields: dict[str, Any]

    def flavor(self, **overrides: Any) -> WanFlavor:
        """The flavor to build a model for these weights; ``overrides`` set fields shapes cannot tell
        (``rope_theta``, ``sample_shift``, ``expert_boundary``, ...)."""
        return WanFlavor(**{**self.fields, **overrides})


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it, from the index when there is one, else from every safetensors file."""
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise LoongForgeError(f"{directory}: several index files ({', '.join(p.name for p in indexes)}); keep one")
    if indexes:
        return index_weight_files(indexes[0])
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        nested = sorted(p.parent.name for p in directory.glob("*/*.safetensors"))
        hint = f"; the weights seem to be in the subdirectories {sorted(set(nested))}" if nested else ""
        raise LoongForgeError(f"{directory}: no *.safetensors files{hint}")
    located: dict[str, Path] = {}
    for file in files:
        for name in _names_in(file):
            if name in located:
                raise LoongForgeError(f"tensor '{name}' is in both {located[name]} and {file}")
            located[name] = file
    return located


def _names_in(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except Exception as exc:  # noqa: BLE001 - SafetensorError derives from Exception only
        raise LoongForgeError(f"{file}: not a readable safetensors file: {exc}") from None


def meta_tensors(located: dict[str, Path]) -> dict[str, torch.Tensor]:
    """Every tensor as a meta tensor of its stored shape (reads headers only); a name the index lists but its
    file lacks is an error naming both."""
    metas: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in located.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        _names_in(file)  # readable, or one line naming it
        with safe_open(str(file), framework="pt") as handle:
            present = set(handle.keys())
            for name in names:
                if name not in present:
                    raise LoongForgeError(f"{file}: lacks tensor '{name}', which the index places there")
                metas[name] = torch.empty(handle.get_slice(name).get_shape(), device="meta")
    return metas


def _layout(names: Mapping[str, Any], directory: Path) -> str:
    for layout, (marker, _, _) in _LAYOUTS.items():
        if marker in names:
            return layout
    first = ", ".join(sorted(names)[:3])
    raise LoongForgeError(
        f"{directory}: not a Wan DiT checkpoint in diffusers or original names (neither "
        f"{' nor '.join(repr(m) for m, _, _ in _LAYOUTS.values())} is present; it holds e.g. {first})"
    )


def _config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise LoongForgeError(f"{path}: not valid JSON: {exc}") from None


def _num_heads(dim: int, config: dict[str, Any], given: int | None, directory: Path) -> int:
    """Heads cannot be read from shapes (Wan's q/k RMSNorm spans all heads, so every tensor is ``dim`` wide):
    take them from the caller, else ``config.json`` (diffusers' ``num_attention_heads``, the original's
    ``num_heads``), else the released models' head dim of 128."""
    heads = given or config.get("num_attention_heads") or config.get("num_heads")
    if heads:
        return int(heads)
    if dim % RELEASED_HEAD_DIM:
        raise LoongForgeError(
            f"{directory}: cannot tell the number of attention heads (no config.json, and dim {dim} is not a "
            f"multiple of the released head dim {RELEASED_HEAD_DIM}); pass num_heads"
        )
    return dim // RELEASED_HEAD_DIM


def _lacks(name: str, layout: str, directory: Path, count: int = 1) -> LoongForgeError:
    """The error for a checkpoint without our tensor ``name``, naming what the file would call it (a fused
    tensor of ours is several there; 6 rows split into 2 or 3 parts, and only the names matter)."""
    stored = sorted(_LAYOUTS[layout][2]({name: torch.empty(6, device="meta")}))
    more = f" ({count} tensors missing in all)" if count > 1 else ""
    return LoongForgeError(f"{directory}: the {layout} checkpoint lacks {', '.join(map(repr, stored))} "
                           f"(our '{name}'){more}")


def _infer_fields(shapes: Mapping[str, torch.Size], config: dict[str, Any], num_heads: int | None,
                  layout: str, directory: Path) -> dict[str, Any]:
    """The :class:`WanFlavor` fields that ``shapes`` (our names) and the optional ``config.json`` determine."""
    needed = ("patch_embed.proj.weight", "head.proj.weight", "blocks.0.ffn.fc1.weight", "text_embed.fc1.weight",
              "time_embed.mlp_in.weight")
    absent = next((name for name in needed if name not in shapes), None)
    if absent is not None:
        raise _lacks(absent, layout, directory)
    patch_weight = shapes["patch_embed.proj.weight"]
    dim, in_channels, patch = patch_weight[0], patch_weight[1], tuple(patch_weight[2:])
    layers = sorted({int(m.group(1)) for name in shapes if (m := _BLOCK_INDEX.match(name))})
    if not layers or layers != list(range(len(layers))):
        raise LoongForgeError(f"{directory}: transformer blocks {layers} are not numbered 0..n-1")
    with_image = "image_embed.fc1.weight" in shapes
    out_channels = shapes["head.proj.weight"][0] // math.prod(patch)
    task = config.get("model_type")
    if task not in TASKS:
        if with_image or in_channels != out_channels:
            task = "i2v"
        else:
            task = "ti2v" if in_channels == WAN22_VAE_CHANNELS else "t2v"
    fields = {
        "task": task, "dim": dim, "ffn_dim": shapes["blocks.0.ffn.fc1.weight"][0],
        "num_heads": _num_heads(dim, config, num_heads, directory), "num_layers": len(layers),
        "in_channels": in_channels, "out_channels": out_channels, "patch_size": patch,
        "text_dim": shapes["text_embed.fc1.weight"][1], "freq_dim": shapes["time_embed.mlp_in.weight"][1],
        "cross_attn_norm": "blocks.0.norm_cross.weight" in shapes,
        "image_dim": shapes["image_embed.fc1.weight"][1] if with_image else None,
        "per_token_timesteps": task == "ti2v",
    }
    if "eps" in config:
        fields["eps"] = float(config["eps"])
    if task == "ti2v":
        fields["version"] = "2.2"
    return fields


def _check_against(flavor: WanFlavor, shapes: Mapping[str, torch.Size], layout: str, directory: Path) -> None:
    with torch.device("meta"):
        expected = {name: tensor.shape for name, tensor in WanModel(flavor).state_dict().items()}
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing:
        raise _lacks(missing[0], layout, directory, len(missing))
    if extra:
        raise LoongForgeError(f"{directory}: the {layout} checkpoint has our '{extra[0]}' ({len(extra)} such), "
                              "which the model its other tensors describe does not (an image branch without "
                              "img_emb, or the reverse?)")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise LoongForgeError(f"{directory}: our '{name}' would have shape {list(shapes[name])}, "
                                  f"the model its other shapes describe needs {list(shape)}")


def checkpoint_shapes(path: str | Path, *, num_heads: int | None = None) -> dict[str, torch.Size]:
    """Our names and shapes of the Wan DiT checkpoint in directory ``path``, from its files' headers alone, checked
    as :func:`load_wan_checkpoint` checks them (what ``check`` holds ``task.init`` to before anything loads)."""
    return _inspect(Path(path).expanduser(), num_heads)[2]


def _inspect(directory: Path, num_heads: int | None) -> tuple[dict[str, Path], str, dict[str, torch.Size],
                                                               dict[str, Any]]:
    """Where each tensor is, the layout, our names' shapes and the flavor fields they describe (headers only)."""
    if not directory.is_dir():
        raise LoongForgeError(f"{directory}: not a directory (pass the folder holding the *.safetensors files)")
    located = weight_files(directory)
    layout = _layout(located, directory)
    shapes = {name: t.shape for name, t in _LAYOUTS[layout][1](meta_tensors(located)).items()}
    fields = _infer_fields(shapes, _config(directory), num_heads, layout, directory)
    _check_against(WanFlavor(**fields), shapes, layout, directory)
    return located, layout, shapes, fields


def load_wan_checkpoint(path: str | Path, *, num_heads: int | None = None) -> WanCheckpoint:
    """Load the Wan DiT checkpoint in directory ``path`` (diffusers or original names) into our names.

    :param num_heads: attention heads, for a checkpoint without ``config.json`` whose heads are not 128 wide.
    """
    located, layout, _, fields = _inspect(Path(path).expanduser(), num_heads)
    convert = _LAYOUTS[layout][1]
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(located.values())):
        loaded = load_file(str(file))
        tensors.update({name: loaded[name] for name, where in located.items() if where == file})
    return WanCheckpoint(convert(tensors), layout, fields)
