"""The diffusion families' pre-flight (``ModelFamily.check_task``): what ``loongforge check`` and ``train`` open
before anything is built, so that a data set or an option training would trip over is one line naming the key.

The task is made as training makes it (its options, geometry, LoRA and EMA settings), its data set opened the way
training opens it and its first sample read -- a truncated, empty or text ``.pt``, a ``.jsonl`` of what is not a
video, a latent cache with a missing file fail here -- and the sample's shape is held to the model's patch size
(a video whose frames or side the patch does not divide cannot be cut into tokens).
"""

from __future__ import annotations

import pickle
from typing import Any

from loongforge.errors import ConfigError, LoongForgeError


def check_video_task(flavor: Any, config: Any, options: Any) -> list[str]:
    """One summary line for a Wan task's data; a :class:`ConfigError` naming ``task.data`` (or the geometry) when
    training could not read or patch it."""
    task = flavor.make_task(config)
    where = f"{config.source}: task.data {options.data}" if options.data else f"{config.source}: task"
    try:
        dataset = task.build_dataset()
        if len(dataset) == 0:
            raise ConfigError(f"{where}: holds no sample")
        sample = dataset[0]
    except LoongForgeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except pickle.UnpicklingError:
        raise ConfigError(f"{where}: not a data file torch.load reads with weights_only (written by `loongforge "
                          "make-data moving-squares`; a file that would run code is never loaded)") from None
    except Exception as exc:  # noqa: BLE001 -- whatever a damaged file raises, it is the data's problem, in one line
        said = (str(exc).strip().splitlines() or ["empty, or cut short"])[0]
        raise ConfigError(f"{where}: cannot be read as training reads it ({type(exc).__name__}: {said})") from None
    video = sample.get("video")
    if video is None or video.dim() != 4:
        raise ConfigError(f"{where}: a sample must hold a video (channels, frames, height, width), got "
                          f"{None if video is None else list(video.shape)}")
    patch = task.flavor.patch_size
    frames, height, width = video.shape[1:]
    if frames % patch[0] or height % patch[1] or width % patch[2]:
        raise ConfigError(f"{config.source}: task.frames/side: videos of {frames} x {height} x {width} (frames x "
                          f"height x width{' in latents' if options.data else ''}) do not divide into the model's "
                          f"{'x'.join(map(str, patch))} patches")
    return [f"task.data: {len(dataset)} sample(s) of {frames} x {height} x {width}"]
