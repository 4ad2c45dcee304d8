"""A cache of VAE latents and text-encoder states, so DiT training never runs the frozen encoders again.

Training a Wan DiT sees each clip many times, while its VAE and text encoder are frozen: encoding once and
reading the results back saves most of the step time and all of their memory. The command::

    loongforge cache-latents --vae DIR --text-encoder DIR --videos JSONL_OR_DIR --out OUT_DIR \
        [--tokenizer DIR] [--frames 81 --height 480 --width 832] [--text-len 512] [--batch 4] [--shard-size 256] \
        [--i2v [--image-encoder DIR]]

reads captioned videos (:mod:`loongforge_diffusion.data.video_files`), encodes them as the diffusers Wan
pipelines do (progress per video), and writes ``OUT_DIR/latents-00000.safetensors ...`` plus ``index.json``.
``--vae`` is a diffusers ``AutoencoderKLWan`` directory, ``--text-encoder`` a transformers
``UMT5EncoderModel``/``T5EncoderModel`` directory (with its tokenizer, or ``--tokenizer``); both load with
``local_files_only`` -- nothing is downloaded. The command's arguments are in :mod:`loongforge_diffusion.commands`.

- video: the posterior mean of the VAE, normalised per channel as ``(z - latents_mean) / latents_std`` with the
  VAE config's statistics (what ``WanPipeline`` undoes before decoding);
- caption: whitespace-normalised, tokenised to ``text_len`` (padded, truncated), encoded with the attention mask,
  and zeroed past its length (what ``WanPipeline.encode_prompt`` feeds the DiT); the mask is stored too;
- ``--i2v``: the image-to-video conditioning of the clip's first frame, as ``WanImageToVideoPipeline`` builds it
  (``prepare_latents``): the first frame followed by black frames through the VAE (posterior mode, normalised),
  behind the 4-channel mask that marks the first latent frame's frames as given -- ``condition (4 + C, T, H, W)``,
  which the I2V DiT takes concatenated to its noisy input; with ``--image-encoder`` (a transformers
  ``CLIPVisionModel`` with its ``CLIPImageProcessor``; Wan 2.1 I2V) also the first frame's CLIP tokens, the
  encoder's penultimate hidden states (``encode_image``) -- ``image_context (M, image_dim)``.

Each shard holds ``video (N, C, T, H, W)``, ``context (N, L, D)``, ``mask (N, L)`` (and ``condition``,
``image_context`` with ``--i2v``) and, as metadata, the captions and sources. The output is written to a temporary
directory and renamed into place when complete, so a reader never sees a half-written cache, and an existing output
is never overwritten.
:class:`CachedLatentDataset` reads it back; ``task.data: OUT_DIR`` trains on it with ``loongforge train``.
"""

from __future__ import annotations

import bisect
import hashlib
import html
import importlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loongforge.data.errors import DataError
from loongforge.progress import job_progress
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset

from loongforge_diffusion.commands import ENCODE_DTYPES
from loongforge_diffusion.data.video_files import Clip, fit, list_clips

INDEX = "index.json"
FORMAT = "loongforge-latents"
VERSION = 1
NORMALISATION = "(z - latents_mean) / latents_std, z = the VAE posterior mean"
DTYPES = {name: getattr(torch, name) for name in ENCODE_DTYPES}
TEXT_ENCODERS = {"umt5": "UMT5EncoderModel", "t5": "T5EncoderModel"}
#: What a sample of a cache holds for training, beside the caption mask; the last two only in an ``--i2v`` cache.
SAMPLE_KEYS = ("video", "context", "condition", "image_context")
#: Channels of the I2V mask in front of the condition latents (the VAE's temporal factor: one per folded frame).
I2V_MASK_CHANNELS = 4


def shard_name(number: int) -> str:
    return f"latents-{number:05d}.safetensors"


def _import(module: str, package: str) -> Any:
    """``module``, or a one-line error naming the package to install (diffusers is an optional dependency)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"the latent cache needs {package}: pip install {package} "
                        f"(or pip install 'loongforge-diffusion[preprocess]')") from None


def _component(path: str | Path, what: str) -> tuple[Path, dict[str, Any]]:
    """A local model directory and its identity for ``index.json`` (path, config hash)."""
    directory = Path(path).expanduser().resolve()
    config = directory / "config.json"
    if not config.is_file():
        raise DataError(f"{what} {directory}: no config.json (expected a saved diffusers/transformers directory)")
    return directory, {"path": str(directory), "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest()}


@dataclass
class Encoders:
    """The frozen VAE, text encoder and tokenizer, and what ``index.json`` records about them."""

    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    identity: dict[str, Any]
    #: ``--image-encoder``: a CLIP vision model and its image processor (Wan 2.1 I2V's image tokens).
    image_encoder: torch.nn.Module | None = None
    image_processor: Any = None

    @property
    def latents_mean(self) -> torch.Tensor:
        return torch.tensor(self.vae.config.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)

    @property
    def latents_std(self) -> torch.Tensor:
        return torch.tensor(self.vae.config.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)

    @torch.no_grad()
    def encode_videos(self, videos: torch.Tensor) -> torch.Tensor:
        """``(B, 3, T, H, W)`` pixels in [-1, 1] -> normalised latents ``(B, C, t, h, w)`` (float32)."""
        z = self.vae.encode(videos.to(self.device, self.dtype)).latent_dist.mean.float().cpu()
        return (z - self.latents_mean) / self.latents_std

    @torch.no_grad()
    def encode_condition(self, videos: torch.Tensor) -> torch.Tensor:
        """``(B, 3, T, H, W)`` pixels -> the I2V ``condition (B, 4 + C, t, h, w)`` of each first frame (module
        docstring): the mask, then the normalised posterior mode of the first frame followed by black frames."""
        first = videos[:, :, :1]
        kept = torch.cat([first, first.new_zeros(first.shape[0], 3, videos.shape[2] - 1, *first.shape[3:])], dim=2)
        z = self.vae.encode(kept.to(self.device, self.dtype)).latent_dist.mode().float().cpu()
        latents = (z - self.latents_mean) / self.latents_std
        folded = self.vae.config.scale_factor_temporal
        if folded != I2V_MASK_CHANNELS:
            raise DataError(f"--vae: temporal factor {folded}; Wan's I2V mask has {I2V_MASK_CHANNELS} channels")
        mask = torch.zeros(latents.shape[0], folded, *latents.shape[2:])
        mask[:, :, 0] = 1  # the first latent frame holds the given first frame (its first `folded` frames)
        return torch.cat([mask, latents], dim=1)

    @torch.no_grad()
    def encode_images(self, videos: torch.Tensor) -> torch.Tensor:
        """The first frames' CLIP tokens ``(B, M, image_dim)``: the image encoder's penultimate hidden states."""
        frames = ((videos[:, :, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
        pixels = self.image_processor(images=list(frames.permute(0, 2, 3, 1).numpy()), return_tensors="pt")
        states = self.image_encoder(pixel_values=pixels["pixel_values"].to(self.device, self.dtype),
                                    output_hidden_states=True).hidden_states[-2]
        return states.float().cpu()

    @torch.no_grad()
    def encode_captions(self, captions: list[str], text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Captions -> ``context (B, text_len, D)`` (zero past each caption) and ``mask (B, text_len)``."""
        tokens = self.tokenizer([clean_caption(c) for c in captions], padding="max_length", max_length=text_len,
                                truncation=True, add_special_tokens=True, return_attention_mask=True,
                                return_tensors="pt")
        ids, mask = tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device)
        states = self.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        return (states * mask[..., None]).cpu(), mask.bool().cpu()


def clean_caption(text: str) -> str:
    """HTML entities resolved and whitespace collapsed, as Wan's ``prompt_clean`` does (without its ftfy pass)."""
    return " ".join(html.unescape(html.unescape(text)).split())


def load_encoders(vae: str | Path, text_encoder: str | Path, tokenizer: str | Path | None = None, *,
                  device: str = "cpu", dtype: str = "float32", image_encoder: str | Path | None = None) -> Encoders:
    """The Wan VAE (diffusers), a T5/UMT5 encoder + tokenizer and, for I2V, a CLIP vision encoder + its image
    processor (transformers), from local directories only."""
    diffusers = _import("diffusers", "diffusers")
    transformers = _import("transformers", "transformers")
    vae_dir, vae_id = _component(vae, "--vae")
    text_dir, text_id = _component(text_encoder, "--text-encoder")
    tokenizer_dir = Path(tokenizer).expanduser().resolve() if tokenizer else text_dir
    model_type = json.loads((text_dir / "config.json").read_text()).get("model_type")
    if model_type not in TEXT_ENCODERS:
        raise DataError(f"--text-encoder {text_dir}: model_type {model_type!r} is not a T5-family encoder "
                        f"({', '.join(TEXT_ENCODERS)})")
    torch_dtype, target = DTYPES[dtype], torch.device(device)
    try:
        vae_model = diffusers.AutoencoderKLWan.from_pretrained(str(vae_dir), local_files_only=True,
                                                               torch_dtype=torch_dtype)
        encoder_cls = getattr(transformers, TEXT_ENCODERS[model_type])
        encoder = encoder_cls.from_pretrained(str(text_dir), local_files_only=True)
        tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot load the encoders: {' '.join(str(exc).split())}") from None
    if vae_model.config.latents_mean is None or vae_model.config.latents_std is None:
        raise DataError(f"--vae {vae_dir}: config.json has no latents_mean/latents_std to normalise with")
    identity = {"vae": {**vae_id, "class": type(vae_model).__name__},
                "text_encoder": {**text_id, "class": type(encoder).__name__, "tokenizer": str(tokenizer_dir)}}
    encoders = Encoders(vae_model.to(target).eval(), encoder.to(target, torch_dtype).eval(), tok, target,
                        torch_dtype, identity)
    if image_encoder is not None:
        image_dir, image_id = _component(image_encoder, "--image-encoder")
        try:
            encoders.image_encoder = transformers.CLIPVisionModel.from_pretrained(
                str(image_dir), local_files_only=True).to(target, torch_dtype).eval()
            encoders.image_processor = transformers.CLIPImageProcessor.from_pretrained(str(image_dir),
                                                                                       local_files_only=True)
        except (OSError, ValueError) as exc:
            raise DataError(f"--image-encoder {image_dir}: cannot load a CLIPVisionModel and its "
                            f"CLIPImageProcessor: {' '.join(str(exc).split())}") from None
        identity["image_encoder"] = {**image_id, "class": "CLIPVisionModel"}
    return encoders


class _ShardWriter:
    """Collects encoded samples and writes full shards into a temporary directory beside ``out``; ``commit``
    adds ``index.json`` and renames the directory to ``out``."""

    def __init__(self, out: Path, shard_size: int) -> None:
        self.out, self.shard_size = out, shard_size
        self.tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.pending: dict[str, list[Any]] = {"caption": [], "source": []}
        self.shards: list[dict[str, Any]] = []

    def add(self, tensors: dict[str, torch.Tensor], clips: list[Clip]) -> None:
        """``tensors`` (``video``, ``context``, ``mask`` and any conditioning), one row per clip of ``clips``."""
        for i, clip in enumerate(clips):
            for key, value in (*((key, rows[i]) for key, rows in tensors.items()),
                               ("caption", clip.caption), ("source", clip.source)):
                self.pending.setdefault(key, []).append(value)
            if len(self.pending["caption"]) == self.shard_size:
                self.flush()

    def flush(self) -> None:
        if not self.pending["caption"]:
            return
        name = shard_name(len(self.shards))
        tensors = {key: torch.stack(rows).contiguous() for key, rows in self.pending.items()
                   if key not in ("caption", "source")}
        metadata = {key: json.dumps(self.pending[key]) for key in ("caption", "source")}
        save_file(tensors, str(self.tmp / name), metadata=metadata)
        _finish_file(self.tmp / name)
        self.shards.append({"file": name, "count": len(self.pending["caption"])})
        self.pending = {key: [] for key in self.pending}

    def commit(self, index: dict[str, Any]) -> dict[str, Any]:
        self.flush()
        index = {**index, "shards": self.shards}
        (self.tmp / INDEX).write_text(json.dumps(index, indent=1) + "\n")
        _finish_file(self.tmp / INDEX)
        if self.out.exists():
            raise DataError(f"{self.out} appeared while encoding; it is not overwritten")
        os.rename(self.tmp, self.out)
        return index

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _finish_file(path: Path) -> None:
    """Flush ``path`` to disk and give it the usual permissions (safetensors creates files owner-only)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _check_geometry(encoders: Encoders, frames: int, height: int, width: int) -> None:
    config = encoders.vae.config
    temporal, spatial = config.scale_factor_temporal, config.scale_factor_spatial
    if frames < 1 or (frames - 1) % temporal:
        raise DataError(f"--frames {frames}: the Wan VAE encodes 1 + {temporal}k frames "
                        f"(e.g. {1 + temporal * max((frames - 1) // temporal, 1)})")
    for name, size in (("--height", height), ("--width", width)):
        if size < spatial or size % spatial:
            raise DataError(f"{name} {size}: must be a positive multiple of the VAE's spatial factor {spatial}")


def build_cache(videos: str | Path, encoders: Encoders, out: str | Path, *, frames: int | None = None,
                height: int | None = None, width: int | None = None, text_len: int = 512, batch: int = 4,
                shard_size: int = 256, i2v: bool = False) -> dict[str, Any]:
    """Encode every clip of ``videos`` into a new cache directory ``out`` (progress per video); returns its index.

    ``frames``/``height``/``width`` default to the first clip's own size; ``i2v`` adds each first frame's
    conditioning (and, when ``encoders`` has an image encoder, its CLIP tokens).
    """
    if encoders.image_encoder is not None and not i2v:
        raise DataError("--image-encoder encodes the first frames of an image-to-video cache; add --i2v")
    out = Path(out).expanduser()
    if out.exists():
        raise DataError(f"{out} already exists; choose another --out (a cache is never overwritten)")
    if batch < 1 or shard_size < 1 or text_len < 1:
        raise DataError(f"--batch ({batch}), --shard-size ({shard_size}) and --text-len ({text_len}) must be >= 1")
    clips = list_clips(videos)
    if None in (frames, height, width):
        _, length, rows, cols = clips[0].load().shape
        frames, height, width = frames or length, height or rows, width or cols
    _check_geometry(encoders, frames, height, width)
    writer = _ShardWriter(out, shard_size)
    try:
        with job_progress(f"encoding videos into {out}", total=len(clips), unit="video") as progress:
            for start in range(0, len(clips), batch):
                group = clips[start:start + batch]
                pixels = torch.stack([fit(clip.load(), frames, height, width, source=clip.source) for clip in group])
                context, mask = encoders.encode_captions([clip.caption for clip in group], text_len)
                tensors = {"video": encoders.encode_videos(pixels), "context": context, "mask": mask}
                if i2v:
                    tensors["condition"] = encoders.encode_condition(pixels)
                if encoders.image_encoder is not None:
                    tensors["image_context"] = encoders.encode_images(pixels)
                writer.add(tensors, group)
                progress.advance(len(group), note=group[-1].source)
        index = {"format": FORMAT, "version": VERSION, "count": len(clips),
                 "shapes": {key: list(value.shape[1:]) for key, value in tensors.items() if key in SAMPLE_KEYS},
                 "input": {"frames": frames, "height": height, "width": width, "text_len": text_len},
                 "dtype": "float32", "encode_dtype": str(encoders.dtype).removeprefix("torch."),
                 **encoders.identity,
                 "normalisation": {"formula": NORMALISATION,
                                   "latents_mean": list(encoders.vae.config.latents_mean),
                                   "latents_std": list(encoders.vae.config.latents_std)}}
        return writer.commit(index)
    except BaseException:
        writer.abort()
        raise


class CachedLatentDataset(Dataset):
    """A cache written by :func:`build_cache`, map-style: items ``{"video": (C, T, H, W), "context": (L, D)}``
    and, from an ``--i2v`` cache, ``condition`` and ``image_context`` (float32): the batch keys
    :func:`~loongforge_diffusion.training.flow_matching_step` takes.

    Every shard's header is checked on construction (present, readable, the counts and shapes of
    ``index.json``); a sample's values are checked when read (finite). ``latent_channels``/``text_dim``, when
    given, must match the cache -- the model's ``out_channels``/``text_dim``; ``in_channels`` (the model's input:
    latents plus any conditioning) and ``image_dim`` (its CLIP branch, ``None`` for none) likewise.
    """

    def __init__(self, path: str | Path, *, latent_channels: int | None = None, text_dim: int | None = None,
                 in_channels: int | None = None, image_dim: int | None = None):
        self.path = Path(path).expanduser()
        index = _read_index(self.path)
        self.index = index
        self.shapes = {key: tuple(index["shapes"][key]) for key in SAMPLE_KEYS if key in index["shapes"]}
        self.shards = [self.path / shard["file"] for shard in index["shards"]]
        counts = [int(shard["count"]) for shard in index["shards"]]
        self.starts = [sum(counts[:i]) for i in range(len(counts))]
        self.length = sum(counts)
        for shard, count in zip(self.shards, counts, strict=True):
            self._check_shard(shard, count)
        for name, want, have in (("latent channels", latent_channels, self.shapes["video"][0]),
                                 ("text_dim", text_dim, self.shapes["context"][1])):
            if want is not None and want != have:
                raise DataError(f"{self.path}: the cache has {name} {have} but the model expects {want}; "
                                f"set model.overrides to match the VAE/text encoder the cache was made with")
        if in_channels is not None:
            self._check_conditioning(in_channels, image_dim)

    def _check_conditioning(self, in_channels: int, image_dim: int | None) -> None:
        """The model's input channels are the latents' plus the cache's I2V condition; its CLIP branch needs the
        cache's image tokens (and a model without one cannot use them)."""
        latent = self.shapes["video"][0]
        condition = self.shapes["condition"][0] if "condition" in self.shapes else 0
        if latent + condition != in_channels:
            has = f"an I2V condition of {condition} channels" if condition else "no I2V condition (no --i2v)"
            raise DataError(f"{self.path}: the model takes {in_channels} input channels but the cache gives "
                            f"{latent} latent channels and {has}; an I2V flavor needs a cache written with --i2v, "
                            "a T2V flavor one without")
        tokens = self.shapes.get("image_context")
        if image_dim is not None and tokens is None:
            raise DataError(f"{self.path}: the model has a CLIP image branch (image_dim {image_dim}) but the cache "
                            "holds no image tokens; write it with --i2v --image-encoder DIR")
        if tokens is not None and tokens[-1] != image_dim:
            want = "no image tokens" if image_dim is None else f"image_dim {image_dim}"
            raise DataError(f"{self.path}: the cache holds CLIP tokens of width {tokens[-1]} but the model takes "
                            f"{want}")

    def _check_shard(self, shard: Path, count: int) -> None:
        if not shard.is_file():
            raise DataError(f"{shard}: missing shard (listed in {self.path / INDEX})")
        try:
            with safe_open(str(shard), framework="pt") as handle:
                found = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
        except SafetensorError as exc:
            raise DataError(f"{shard}: corrupt shard ({exc}); re-run the latents command") from None
        for key in self.shapes:
            want = (count, *self.shapes[key])
            if found.get(key) != want:
                raise DataError(f"{shard}: {key} has shape {found.get(key)}, index.json says {want}")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        number = bisect.bisect_right(self.starts, index) - 1
        shard, local = self.shards[number], index - self.starts[number]
        try:
            with safe_open(str(shard), framework="pt") as handle:
                item = {key: handle.get_slice(key)[local].float() for key in self.shapes}
        except SafetensorError as exc:
            raise DataError(f"{shard}: corrupt shard ({exc}); re-run the latents command") from None
        for key, value in item.items():
            if not torch.isfinite(value).all():
                raise DataError(f"{shard}: sample {local} (dataset index {index}) has NaN/inf in {key}")
        return item


def _read_index(path: Path) -> dict[str, Any]:
    file = path / INDEX
    if not file.is_file():
        raise DataError(f"{path}: no {INDEX}; write a cache with loongforge cache-latents")
    try:
        index = json.loads(file.read_text())
        ok = index.get("format") == FORMAT and isinstance(index["shards"], list) and index["shapes"]
    except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
        ok = False
    if not ok:
        raise DataError(f"{file}: not a {FORMAT} index (format, shapes and shards expected)")
    if index.get("version") != VERSION:
        raise DataError(f"{file}: version {index.get('version')} is not supported (this reader: {VERSION})")
    return index


if __name__ == "__main__":  # the old front-end: say where it went rather than exit 0 having done nothing
    raise SystemExit("python -m loongforge_diffusion.data.latents is now `loongforge cache-latents ...`")
