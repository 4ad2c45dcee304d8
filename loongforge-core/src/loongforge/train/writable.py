"""The directories a run writes -- ``run.output_dir`` and the checkpoint root -- proved writable before step 1.

Why before: an unwritable ``checkpoint.dir`` used to surface at the first save, after every step up to it had been
trained. Why a probe file rather than the permission bits: root ignores the bits, and a read-only mount, a full
quota or a squashing network file system does not show in them; creating and removing a file answers the real
question. ``loongforge check`` must not create anything, so it probes the nearest directory that exists (where
``train`` would create the rest); ``train`` creates the directories, then probes each (every rank: all of them
write checkpoint files). Torch-free (``check`` runs it).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import ConfigError


def run_directories(config: LoongForgeConfig) -> list[tuple[str, Path]]:
    """``(what to call it in a message, path)`` for each directory the run writes, the output directory first
    (the default checkpoint root lies inside it)."""
    output = Path(config.run.output_dir)
    checkpoints = ("checkpoint.dir", Path(config.checkpoint.dir)) if config.checkpoint.dir else (
        "checkpoint.dir (default <run.output_dir>/checkpoints)", output / "checkpoints")
    return [("run.output_dir", output), checkpoints]


def check_writable(config: LoongForgeConfig, *, create: bool) -> None:
    """Refuse, in one line naming the key and the path, a run directory this process cannot write; ``create``
    makes the directories first (``train``), otherwise the nearest existing one is probed (``check``)."""
    for key, path in run_directories(config):
        try:
            if create:
                path.mkdir(parents=True, exist_ok=True)
            _probe(path if create else _nearest_existing(path))
        except OSError as exc:
            raise ConfigError(f"{config.source}: {key} names {path}, which is not writable "
                              f"({exc.strerror or exc})") from None


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (a file there fails the probe: it cannot hold a directory)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe(directory: Path) -> None:
    """Create and remove a uniquely named file in ``directory`` (ranks probing one directory do not collide)."""
    fd, name = tempfile.mkstemp(prefix=".loongforge-write-probe-", dir=directory)
    os.close(fd)
    os.unlink(name)
