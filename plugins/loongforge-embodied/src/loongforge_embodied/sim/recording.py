"""Rollout videos of closed-loop episodes: what the evaluator saw, one file per episode.

A :class:`RolloutRecorder` renders one camera of the simulator after the reset and after every step of an episode
and writes the frames as ``episode-<index>-<success|failure>.<mp4|gif>``, so a person can tell from a directory
listing which episodes failed and watch how. The video camera is rendered separately from the policy's cameras (at
its own size), so recording never changes what the policy sees: an episode's actions and outcome are the same with
videos on or off.

Formats: MP4 (H.264 through PyAV, the encoder the LeRobot writer already uses; small files, any player) and GIF
(Pillow; opens in a browser or an image viewer, larger). Frames are played at ``fps`` whatever the simulator's
control rate: Meta-World acts at 80 Hz, which GIF cannot show (viewers stretch frame delays under 20 ms), so the
default 20 fps plays a rollout four times slower than real time and shows every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from loongforge.train.media import gif_bytes

from loongforge_embodied.data.video import encode_video
from loongforge_embodied.sim.environment import SimEnvironment

#: The file formats a rollout can be written in.
VIDEO_FORMATS = ("mp4", "gif")
#: Key-frame interval of rollout MP4s: seeking is not needed, so only file size matters.
MP4_GOP = 32
#: H.264 quality of rollout MP4s (visually lossless at these sizes).
MP4_CRF = 18


def write_rollout(path: Path, frames: np.ndarray, fps: int) -> None:
    """Write ``frames`` (T, H, W, 3) uint8 in the format ``path``'s suffix names (one of :data:`VIDEO_FORMATS`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gif":
        path.write_bytes(gif_bytes(frames, fps))
    else:
        encode_video(path, frames, fps, crf=MP4_CRF, gop=MP4_GOP)


@dataclass
class RolloutRecorder:
    """Records episodes of one camera into ``directory`` (see the module docstring).

    :param camera: the simulator camera to film; ``None``: the environment's own ``video_camera`` (Meta-World's
        ``corner`` looks at the table from a corner, LIBERO's ``agentview`` over the robot's shoulder).
    :param size: frame side in pixels (MP4 needs an even side; the evaluator's options keep it so).
    """

    directory: Path
    camera: str | None = None
    size: int = 128
    fps: int = 20
    format: str = "mp4"
    #: Frames of the episodes being filmed, by episode index (a batched evaluation films several at once).
    _frames: dict[int, list[np.ndarray]] = field(default_factory=dict, init=False, repr=False)
    #: Per episode, one strip per chunk: the observed frame and the frames the policy predicted (:meth:`imagine`).
    _imagined: dict[int, list[np.ndarray]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.format not in VIDEO_FORMATS:
            raise ValueError(f"video format must be one of {VIDEO_FORMATS}, got {self.format!r}")

    def beside(self, name: str) -> RolloutRecorder:
        """A recorder with the same settings writing into ``<directory>/<name>`` (a baseline's episodes next to
        the policy's)."""
        return replace(self, directory=self.directory / name)

    def capture(self, env: SimEnvironment, index: int) -> None:
        """Add ``env``'s current frame to episode ``index`` (call after the reset and after each step)."""
        self._frames.setdefault(index, []).append(env.render(self.camera or env.video_camera, self.size))

    def imagine(self, index: int, observed: np.ndarray, predicted: np.ndarray) -> None:
        """Add one chunk's strip to episode ``index``: ``observed`` (S, S, 3), the frame the policy acted on, then
        its ``predicted`` (F, S, S, 3) future frames, each scaled to the recorder's size (nearest neighbour)."""
        frames = [observed, *predicted]
        repeat = max(1, self.size // observed.shape[0])
        self._imagined.setdefault(index, []).append(
            np.concatenate([frame.repeat(repeat, axis=0).repeat(repeat, axis=1) for frame in frames], axis=1))

    def finish_predicted(self, index: int, success: bool) -> Path | None:
        """Write episode ``index``'s imagined strips (one video frame per chunk) and forget them; returns the file,
        or ``None`` when the policy imagined nothing."""
        strips = self._imagined.pop(index, None)
        if not strips:
            return None
        path = self.directory / f"episode-{index:03d}-{'success' if success else 'failure'}-predicted.{self.format}"
        write_rollout(path, np.stack(strips), max(1, self.fps // 5))
        return path

    def finish(self, index: int, success: bool) -> Path:
        """Write the frames captured for episode ``index`` and forget them; returns the file."""
        path = self.directory / f"episode-{index:03d}-{'success' if success else 'failure'}.{self.format}"
        write_rollout(path, np.stack(self._frames.pop(index)), self.fps)
        return path
