"""A synthetic, learnable video task: one coloured square moving in a straight line on a black background.

Each sample picks a colour, a direction and a size; the caption naming them is the conditioning. A model that
learns the task must get the colour (per-pixel), the motion (across frames) and the shape (spatial structure)
right, and :mod:`loongforge_diffusion.scoring` measures each analytically -- so tests and tutorials can train
and evaluate a video model with no downloads. Samples are a pure function of ``(seed, index)``: the dataset is
map-style, reproducible and has no storage.

Captions are three tokens (colour, direction, size) looked up in a fixed random embedding table, standing in
for a text encoder's states (``context`` of shape ``(3, text_dim)``).

Command line (writes the tensors to one ``.pt`` file that :class:`TensorVideoDataset` reads; its arguments are in
:mod:`loongforge_diffusion.commands`)::

    loongforge make-data moving-squares OUT.pt --count 512 --seed 0
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from loongforge.data.errors import DataError
from loongforge.progress import track
from torch.utils.data import Dataset

#: RGB in [-1, 1]; every colour has a channel at +1 so foreground is "max channel > 0" on the -1 background.
PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (1.0, -1.0, -1.0), "green": (-1.0, 1.0, -1.0), "blue": (-1.0, -1.0, 1.0),
    "yellow": (1.0, 1.0, -1.0), "cyan": (-1.0, 1.0, 1.0), "magenta": (1.0, -1.0, 1.0),
}
#: (rows, columns) moved per step.
DIRECTIONS: dict[str, tuple[int, int]] = {"right": (0, 1), "left": (0, -1), "down": (1, 0), "up": (-1, 0)}
SIZES: tuple[int, ...] = (3, 4, 5)
VOCAB = len(PALETTE) + len(DIRECTIONS) + len(SIZES)


@dataclass(frozen=True)
class Geometry:
    """Frame count, frame side in pixels and speed in pixels per frame."""

    frames: int = 4
    side: int = 16
    speed: int = 2

    def __post_init__(self) -> None:
        if self.frames < 1 or self.speed < 0:
            raise ValueError(f"{self}: a video needs at least one frame and a speed of at least 0")
        if self.side < max(SIZES) + self.speed * (self.frames - 1):
            raise ValueError(f"{self}: the largest square cannot travel {self.frames - 1} steps inside the frame")


def caption_tokens(labels: torch.Tensor) -> torch.Tensor:
    """``(..., 3)`` labels (colour, direction, size indices) -> token ids in one shared vocabulary."""
    offsets = torch.tensor([0, len(PALETTE), len(PALETTE) + len(DIRECTIONS)], device=labels.device)
    return labels + offsets


def embedding_table(text_dim: int, seed: int = 1234) -> torch.Tensor:
    """The fixed ``(VOCAB, text_dim)`` stand-in for a text encoder: random unit-RMS rows, the same on every run."""
    table = torch.randn(VOCAB, text_dim, generator=torch.Generator().manual_seed(seed))
    return table / table.pow(2).mean(dim=1, keepdim=True).sqrt()


def caption(labels: torch.Tensor, *, moving: bool = True) -> str:
    """The caption of a label triple; a still image (``moving=False``) names no direction."""
    colour, direction, size = (int(v) for v in labels)
    still = f"a {list(PALETTE)[colour]} square of size {SIZES[size]}"
    return f"{still} moving {list(DIRECTIONS)[direction]}" if moving else still


def parse_caption(text: str, *, moving: bool = True) -> torch.Tensor:
    """Labels ``(colour, direction, size)`` of a caption naming one colour, one direction and one size, in any
    wording (``"a red square of size 4 moving right"``, ``"red right 4"``); ``ValueError`` names what is missing.

    For a still image (``moving=False``) the caption names a colour and a size but no direction
    (``"a red square of size 4"``); its direction label is 0, which one frame cannot show anyway.
    """
    words = text.lower().replace(",", " ").split()
    found = []
    for what, names in (("colour", list(PALETTE)), ("direction", list(DIRECTIONS)),
                        ("size", [str(size) for size in SIZES])):
        hits = [names.index(w) for w in words if w in names]
        if what == "direction" and not moving:
            if hits:
                raise ValueError(f"caption {text!r} names a direction, but this model draws still images")
            hits = [0]
        if len(hits) != 1:
            raise ValueError(f"caption {text!r} must name exactly one {what} (one of {', '.join(names)})")
        found.append(hits[0])
    return torch.tensor(found)


def render(labels: torch.Tensor, origin: tuple[int, int], geometry: Geometry) -> torch.Tensor:
    """The video ``(3, frames, side, side)`` in [-1, 1] for one label triple and top-left start ``origin``."""
    colour, direction, size = (int(v) for v in labels)
    side = SIZES[size]
    dy, dx = DIRECTIONS[list(DIRECTIONS)[direction]]
    video = torch.full((3, geometry.frames, geometry.side, geometry.side), -1.0)
    rgb = torch.tensor(PALETTE[list(PALETTE)[colour]])[:, None, None]
    for t in range(geometry.frames):
        top, left = origin[0] + dy * geometry.speed * t, origin[1] + dx * geometry.speed * t
        video[:, t, top:top + side, left:left + side] = rgb
    return video


def random_start(labels: torch.Tensor, geometry: Geometry, generator: torch.Generator) -> tuple[int, int]:
    """A top-left corner from which the square stays fully inside the frame for the whole clip."""
    side = SIZES[int(labels[2])]
    dy, dx = DIRECTIONS[list(DIRECTIONS)[int(labels[1])]]
    travel = geometry.speed * (geometry.frames - 1)
    corner = []
    for step in (dy, dx):
        span = geometry.side - side - (travel if step else 0)
        start = int(torch.randint(span + 1, (1,), generator=generator))
        corner.append(start + (travel if step < 0 else 0))
    return corner[0], corner[1]


class MovingSquares(Dataset):
    """``length`` samples, each ``{"video": (3, T, S, S), "context": (3, text_dim), "labels": (3,)}``."""

    def __init__(self, length: int = 1024, *, text_dim: int = 32, seed: int = 0, geometry: Geometry = Geometry()):
        self.length, self.seed, self.geometry = length, seed, geometry
        self.table = embedding_table(text_dim)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        labels = torch.stack([torch.randint(n, (1,), generator=generator)[0]
                              for n in (len(PALETTE), len(DIRECTIONS), len(SIZES))])
        video = render(labels, random_start(labels, self.geometry, generator), self.geometry)
        return {"video": video, "context": self.table[caption_tokens(labels)], "labels": labels}


class TensorVideoDataset(Dataset):
    """A dataset written by :func:`write` (stacked tensors in one file), read back sample by sample; the file is
    checked whole when opened (:func:`loongforge_diffusion.data.written.read_written`), so a damaged one is one
    :class:`DataError` naming it."""

    def __init__(self, path: str | Path) -> None:
        from loongforge_diffusion.data.written import read_written

        path = Path(path).expanduser()
        stored = read_written(path)
        self.tensors = {k: stored[k] for k in ("video", "context", "labels")}
        geometry = stored["geometry"]
        try:
            self.geometry = Geometry(**geometry)
        except (TypeError, ValueError) as exc:
            raise DataError(f"{path}: 'geometry' {geometry!r} is not one moving squares are made with "
                            f"({exc})") from None
        frames, side = self.tensors["video"].shape[2:4]
        if (frames, side) != (self.geometry.frames, self.geometry.side):
            raise DataError(f"{path}: videos of {frames} frames of side {side}, but 'geometry' says "
                            f"{self.geometry.frames} of side {self.geometry.side}")

    def __len__(self) -> int:
        return self.tensors["labels"].shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v[index] for k, v in self.tensors.items()}


def write(path: str | Path, dataset: MovingSquares) -> Path:
    """Materialise ``dataset`` into ``path`` (so a run can read fixed samples or another tool can inspect them),
    showing progress per video."""
    if len(dataset) < 1:
        raise DataError(f"{path}: a dataset needs at least one video, got {len(dataset)}")
    samples = [dataset[i] for i in track(range(len(dataset)), f"generating moving squares for {path}", unit="video")]
    stored = {k: torch.stack([s[k] for s in samples]) for k in ("video", "context", "labels")}
    stored["geometry"] = asdict(dataset.geometry)
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(stored, path)
    except OSError as exc:
        raise DataError(f"{path}: cannot write the dataset ({exc.strerror or exc})") from None
    return path


if __name__ == "__main__":  # the old front-end: say where it went rather than exit 0 having done nothing
    raise SystemExit(
        "python -m loongforge_diffusion.data.moving_squares is now `loongforge make-data moving-squares OUT ...`")
