"""Malformed data of the plugins' models, each next to the overrides that point a shipped recipe at it, with the text
its one-line error must name:

- **diffusion** (``task.data`` of the Wan recipe): files that are empty, cut short, garbage, text or JSON lines; torch
  files of something else (a tensor, no videos, no samples, a pickle that would run code); moving-squares files
  damaged one way at a time (NaN values, caption states of another width, tensors of different lengths, a geometry
  that is wrong or disagrees with the videos, float labels, frames the model's patch does not divide, fewer samples
  than a batch); a directory that is no latent cache, and latent caches with a bad index, a missing or corrupt shard,
  shapes the index does not list, NaN latents or channels the model does not take;
- **VLM** (``data.paths`` of the VLM recipe read as ``image-text``): no records, records that are not JSON, have no
  messages or no assistant turn, images missing, not images or cut short, placeholders that do not match the images,
  shards that are not tars, gzipped, or hold no record;
- **embodied**: LeRobot sets that read cleanly but cannot train the flavor -- no camera for a camera policy, states
  wider than it pads to, fewer training frames than a batch.

Every case is refused by the family's pre-flight, before anything is built (``before_model``). None is generated for
a plugin that is not installed.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pickle
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fuzz_harness import Case

ROOT = Path(__file__).resolve().parents[2]
DIFFUSION_RECIPE = str(ROOT / "configs" / "diffusion-moving-squares.yaml")
VLM_RECIPE = str(ROOT / "configs" / "vlm-shapes.yaml")
EMBODIED_RECIPE = str(ROOT / "configs" / "embodied-tiny.yaml")
_ASKED = [{"role": "user", "content": "<image> what colour?"}, {"role": "assistant", "content": "red"}]
#: Where the pickle that would run code leaves its mark (the test asserts it never appears).
CODE_RAN = "code-ran"


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _cases(directory: Path, prefix: str, made: dict[str, tuple[str, Callable[[Path], Any], str]],
           argv: Callable[[Path, Path], tuple[str, ...]]) -> list[Case]:
    """A case per ``name: (file name, writer, expected text)``: the writer makes the file in its own folder, and
    ``argv(path, folder)`` is the command line after the command."""
    cases = []
    for name, (filename, write, expected) in made.items():
        workdir = directory / name
        workdir.mkdir(parents=True)
        path = workdir / filename
        write(path)
        cases.append(Case(f"{prefix}:{name}", argv(path, workdir), workdir, (expected.format(path=path),)))
    return cases


# -- diffusion -------------------------------------------------------------------------------------------------------
class RunsCode:
    """Pickles to a call of ``os.system``: a file that would run code if it were unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _squares(count: int = 20, frames: int = 4, **changes: Any) -> Callable[[Path], None]:
    """A moving-squares file as `make-data moving-squares` writes it (``count`` 12-pixel videos for the recipe's
    32-wide captions), with ``changes(stored)`` applied per key."""
    def write(path: Path) -> None:
        import torch
        from loongforge_diffusion.data.moving_squares import Geometry, MovingSquares

        squares = MovingSquares(count, text_dim=32, geometry=Geometry(frames, 12, 2))
        samples = [squares[i] for i in range(count)]
        stored = {key: torch.stack([s[key] for s in samples]) for key in ("video", "context", "labels")}
        stored["geometry"] = {"frames": frames, "side": 12, "speed": 2}
        for key, change in changes.items():
            stored[key] = change(stored[key])
        torch.save(stored, path)

    return write


def _nan_at(index: int) -> Callable[[Any], Any]:
    def change(video: Any) -> Any:
        video = video.clone()
        video[index, 0, 0, 0, 0] = float("nan")
        return video

    return change


def _torch_file(make: Callable[[], Any]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        import torch

        torch.save(make(), path)

    return write


def _cache(video: tuple[int, ...] = (3, 4, 12, 12), count: int = 16, index: Callable[[dict], Any] | None = None,
           shard: Callable[[Path], None] | None = None, nan: bool = False) -> Callable[[Path], None]:
    """A latent cache directory as `loongforge cache-latents` writes it (one shard), broken by ``index`` (an edit of
    index.json), ``shard`` (an edit of the shard file) or ``nan`` (NaN latents in sample 0)."""
    def write(path: Path) -> None:
        import torch
        from loongforge_diffusion.data.latents import FORMAT, INDEX, VERSION, shard_name
        from safetensors.torch import save_file

        path.mkdir()
        latents = torch.zeros(count, *video)
        if nan:
            latents[0, 0, 0, 0, 0] = float("nan")
        save_file({"video": latents, "context": torch.zeros(count, 3, 32), "mask": torch.ones(count, 3)},
                  str(path / shard_name(0)))
        meta = {"format": FORMAT, "version": VERSION, "count": count, "shapes": {"video": list(video),
                "context": [3, 32]}, "shards": [{"file": shard_name(0), "count": count}]}
        if index is not None:
            index(meta)
        (path / INDEX).write_text(json.dumps(meta))
        if shard is not None:
            shard(path / shard_name(0))

    return write


def _code_pickle(path: Path) -> None:
    path.write_bytes(pickle.dumps({"video": RunsCode(path.parent / CODE_RAN)}))


def diffusion_cases(directory: Path) -> list[Case]:
    """``task.data`` of the diffusion recipe broken as users break it; none when the plugin is not installed."""
    if not _installed("loongforge_diffusion"):
        return []
    import torch

    data = "task.data {path}"
    made: dict[str, tuple[str, Callable[[Path], Any], str]] = {
        "empty": ("squares.pt", lambda p: p.write_bytes(b""), data),
        "cut-short": ("squares.pt", lambda p: p.write_bytes(b"PK\x03\x04\x14\x00"), data),
        "garbage": ("squares.pt", lambda p: p.write_bytes(b"garbage"), data),
        "text": ("squares.pt", lambda p: p.write_text("a caption, not a tensor\n"), data),
        "jsonl": ("squares.jsonl", lambda p: p.write_text('{"video": "clip.mp4", "caption": "a square"}\n'), data),
        "no-videos": ("squares.pt", _torch_file(lambda: {"captions": torch.zeros(4, 3, dtype=torch.long)}), data),
        "a-tensor": ("squares.pt", _torch_file(lambda: torch.zeros(2, 2)), data),
        "zero-samples": ("squares.pt", _squares(count=20, video=lambda v: v[:0], context=lambda c: c[:0],
                                                 labels=lambda t: t[:0]), "holds no sample"),
        "code-pickle": ("squares.pt", _code_pickle, "nothing in it was unpickled or run"),
        "nan-video": ("squares.pt", _squares(video=_nan_at(3)), "sample 3 has NaN"),
        "other-caption-width": ("squares.pt", _squares(context=lambda c: c[..., :16]), "(tokens, 32)"),
        "lengths-differ": ("squares.pt", _squares(labels=lambda t: t[:5]), "different numbers of samples"),
        "impossible-geometry": ("squares.pt", _squares(geometry=lambda g: {**g, "speed": 9}), "'geometry'"),
        "geometry-disagrees": ("squares.pt", _squares(geometry=lambda g: {**g, "frames": 2}), "'geometry' says"),
        "float-labels": ("squares.pt", _squares(labels=lambda t: t.float()), "'labels' must be"),
        "frames-not-a-patch-multiple": ("squares.pt", _squares(frames=3), "do not divide into the model's"),
        "fewer-than-a-batch": ("squares.pt", _squares(count=8), "fewer than training.micro_batch_size"),
        "directory": ("squares", lambda p: p.mkdir(), "no latent cache"),
        "cache-index-not-json": ("cache", _cache(shard=lambda s: (s.parent / "index.json").write_text("{")),
                                 "not a loongforge-latents index"),
        "cache-version-2": ("cache", _cache(index=lambda i: i.update(version=2)), "version 2"),
        "cache-shard-missing": ("cache", _cache(shard=lambda s: s.unlink()), "missing shard"),
        "cache-shard-corrupt": ("cache", _cache(shard=lambda s: s.write_bytes(b"\0" * 64)), "corrupt shard"),
        "cache-shapes-differ": ("cache", _cache(index=lambda i: i["shapes"].update(video=[3, 4, 8, 8])),
                                "index.json says"),
        "cache-nan": ("cache", _cache(nan=True), "NaN/inf"),
        "cache-other-channels": ("cache", _cache(video=(16, 4, 12, 12)), "latent channels 16"),
    }

    def argv(path: Path, workdir: Path) -> tuple[str, ...]:
        return (DIFFUSION_RECIPE, f"task.data={path}", "training.steps=1", "task.sample.videos=0",
                f"run.output_dir={workdir / 'run'}")

    return _cases(directory, "diffusion", made, argv)


# -- VLM -------------------------------------------------------------------------------------------------------------
def _png(cut: bool = False) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()[:40] if cut else out.getvalue()


def _records(*records: Any, image: bytes | None = None) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
        if image is not None:
            (path.parent / "picture.png").write_bytes(image)

    return write


def _tar(members: list[tuple[str, bytes]], mode: str = "w") -> Callable[[Path], None]:
    def write(path: Path) -> None:
        with tarfile.open(path, mode=mode) as tar:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

    return write


def vlm_cases(directory: Path) -> list[Case]:
    """Image-text data broken as users break it, refused in one line (a source with no usable sample names the
    first fault, a shard is named); none when the plugin is not installed."""
    if not _installed("loongforge_vlm"):
        return []
    asked = {"messages": _ASKED, "images": ["picture.png"]}
    record = json.dumps(asked).encode()
    made: dict[str, tuple[str, Callable[[Path], Any], str]] = {
        "empty": ("data.jsonl", _records(), "no usable samples"),
        "not-json": ("data.jsonl", _records("a caption"), "not JSON"),
        "missing-image": ("data.jsonl", _records(asked), "picture.png: cannot be read"),
        "not-an-image": ("data.jsonl", _records(asked, image=b"text"), "picture.png: cannot be decoded"),
        "image-cut-short": ("data.jsonl", _records(asked, image=_png(cut=True)), "picture.png: cannot be decoded"),
        "no-messages": ("data.jsonl", _records({"images": []}), "no usable samples"),
        "no-assistant": ("data.jsonl", _records({"messages": _ASKED[:1], "images": ["picture.png"]}, image=_png()),
                         "has no assistant turn"),
        "placeholders-differ": ("data.jsonl", _records({"messages": _ASKED, "images": ["picture.png"] * 2},
                                                       image=_png()), "placeholder"),
        "shard": ("data.tar", lambda p: p.write_bytes(b"garbage"), "not a readable uncompressed tar"),
        "shard-gzipped": ("data.tar", _tar([("a.json", record), ("a.png", _png())], mode="w:gz"),
                          "not a readable uncompressed tar"),
        "shard-without-records": ("data.tar", _tar([("a.png", _png()), ("b.png", _png())]), "has no a.json"),
    }

    def argv(path: Path, workdir: Path) -> tuple[str, ...]:
        return (VLM_RECIPE, "data.dataset=image-text", f"data.paths=[{path}]", "training.steps=1",
                f"run.output_dir={workdir / 'run'}")

    return _cases(directory, "vlm", made, argv)


# -- embodied: LeRobot sets that read cleanly but cannot train the flavor --------------------------------------------
def _lerobot(lengths: tuple[int, ...] = (20, 20, 10), **layout: Any) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        from loongforge_embodied.data.lerobot_writer import VideoOptions, write_lerobot_dataset
        from loongforge_embodied.data.synthetic import synthetic_episodes

        write_lerobot_dataset(path, synthetic_episodes(lengths, **layout), fps=10, version="v3.0",
                              video=VideoOptions(codec="png"))

    return write


def policy_cases(directory: Path) -> list[Case]:
    """LeRobot sets the reader accepts and the policy cannot train on, through the embodied recipe (the last of
    three episodes held out); none when the plugin is not installed."""
    if not _installed("loongforge_embodied"):
        return []
    made: dict[str, tuple[str, Callable[[Path], Any], str]] = {
        "no-camera": ("dataset", _lerobot(cameras=()), "the flavor takes 1 of"),
        "states-wider-than-the-flavor": ("dataset", _lerobot(state_dim=12), "observation.state have 12 dimensions"),
        "actions-wider-than-the-flavor": ("dataset", _lerobot(action_dim=9), "actions have 9 dimensions"),
        "fewer-frames-than-a-batch": ("dataset", _lerobot(lengths=(5, 5, 5)), "fewer than training.micro_batch_size"),
    }

    def argv(path: Path, workdir: Path) -> tuple[str, ...]:
        return (EMBODIED_RECIPE, f"task.data={path}", "task.held_out_episodes=1", "training.steps=1",
                "task.eval.frames=0", f"run.output_dir={workdir / 'run'}")

    return _cases(directory, "embodied", made, argv)
