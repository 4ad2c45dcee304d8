"""What a policy server accepts: a policy's observation schema, each request checked against it, and the message
size the schema implies.

Why the checks are strict: a policy answers whatever it is given -- a NaN state, a 1x1 image stretched to the
input size or a state of the wrong length all come back as plausible-looking actions that a robot would execute.
So every request is checked before it reaches the policy: the ``state`` is a vector of ``state_dim`` finite numbers
(integer or floating dtype), ``images`` holds exactly the policy's cameras, each ``(H, W, 3) uint8`` or ``(3, H, W)``
float in [0, 1] with both sides within :meth:`ObservationSchema.image_sides`, the ``task`` is text and the ``seed`` a
non-negative integer. What is wrong comes back to the client as ``{"error": ...}``; the connection stays usable.

The schema also sizes the server's message cap (:meth:`ObservationSchema.default_message_bytes`): the largest
request a client has reason to send is its images at the policy's own size in the widest encoding the protocol
allows (float32 CHW), plus the state and a task text. The cap allows :data:`HEADROOM` times that (cameras send more
pixels than the policy's input; the policy resizes), so legitimate traffic passes while a single request can no
longer make the server hold tens of MiB.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

#: An image side below ``image_size / MIN_SIDE_DIVISOR`` is refused: upsampling it more than twice would invent most
#: of the pixels the policy sees (a 1x1 "image" is a wrong array, not a camera).
MIN_SIDE_DIVISOR = 2
#: An image side above ``MAX_SIDE_FACTOR * image_size`` is refused (a 224 px policy takes up to 1792 px cameras).
MAX_SIDE_FACTOR = 8
#: The default message cap is this many times the largest expected observation (see the module docstring) ...
HEADROOM = 8
#: ... plus this much for the task text, the keys and msgpack's framing.
TEXT_ALLOWANCE = 64 * 2**10
#: Request keys, and the one-line reminder of what each is.
KEYS = ("task", "state", "images", "seed")
IMAGE_FORMS = "(H, W, 3) uint8 or (3, H, W) float in [0, 1]"


class RequestError(ValueError):
    """A request the server will not pass to the policy; its text goes back to the client as ``{"error": ...}``."""


@dataclass(frozen=True)
class ObservationSchema:
    """What one request must hold for a policy: its state length (``None``: any), camera keys and input image side.

    :func:`ObservationSchema.from_metadata` reads it from the metadata a policy carries (and the server sends)."""

    state_dim: int | None
    cameras: tuple[str, ...]
    #: The side the policy resizes each camera to; required when there are cameras.
    image_size: int | None

    def __post_init__(self) -> None:
        if self.cameras and not self.image_size:
            raise ValueError(f"a policy with cameras {list(self.cameras)} must give its image_size in its metadata")

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ObservationSchema:
        return cls(metadata.get("state_dim"), tuple(metadata.get("cameras") or ()), metadata.get("image_size"))

    def image_sides(self) -> tuple[int, int]:
        """The smallest and largest image side (height or width) accepted, in pixels."""
        size = int(self.image_size or 0)
        return -(-size // MIN_SIDE_DIVISOR), MAX_SIDE_FACTOR * size

    def expected_bytes(self) -> int:
        """The largest legitimate observation at the policy's own size: float32 CHW images, a float64 state."""
        return len(self.cameras) * 3 * int(self.image_size or 0) ** 2 * 4 + 8 * int(self.state_dim or 0)

    def default_message_bytes(self) -> int:
        """The message cap a server uses unless told otherwise: ``HEADROOM`` x :meth:`expected_bytes` plus
        ``TEXT_ALLOWANCE`` (e.g. 13.8 MiB for three 224 px cameras and a 32-value state)."""
        return HEADROOM * self.expected_bytes() + TEXT_ALLOWANCE

    def parse(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """``task``, ``state`` (float64), ``images`` and ``seed`` of a request that passes every check; else a
        :class:`RequestError` saying what was wrong."""
        unknown = sorted(set(message) - set(KEYS))
        if unknown:
            raise RequestError(f"unknown request keys {unknown}; send task, state, images (optional), seed (optional)")
        if not isinstance(message.get("task"), str):
            raise RequestError("'task' must be the instruction text (a string)")
        if "state" not in message:
            raise RequestError("'state' is missing (the robot state in the dataset's units)")
        seed = message.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise RequestError(f"'seed' must be an integer in [0, 2**63), got {seed!r}")
        return {"task": message["task"], "state": self._state(message["state"]),
                "images": self._images(message.get("images")), "seed": seed}

    def _state(self, value: Any) -> np.ndarray:
        array = _array("'state'", value)
        if array.dtype.kind not in "iuf":
            raise RequestError(f"'state' has dtype {array.dtype}; send numbers (a float or integer vector)")
        if array.ndim != 1 or (self.state_dim is not None and array.shape[0] != self.state_dim):
            wanted = f"a vector of {self.state_dim}" if self.state_dim is not None else "a vector"
            raise RequestError(f"'state' has shape {list(array.shape)}; the policy takes {wanted}")
        state = array.astype(np.float64)
        bad = np.flatnonzero(~np.isfinite(state))
        if len(bad):
            raise RequestError(f"'state' is not finite at index {bad[:8].tolist()} ({state[bad[:8]].tolist()})")
        return state

    def _images(self, value: Any) -> dict[str, np.ndarray]:
        images = {} if value is None else value
        if not isinstance(images, dict):
            raise RequestError("'images' must map camera keys to arrays")
        missing = [key for key in self.cameras if key not in images]
        unknown = sorted(str(key) for key in images if key not in self.cameras)
        if missing or unknown:
            raise RequestError(f"'images' must hold exactly the policy's cameras {list(self.cameras)}; missing "
                               f"{missing}, unknown {unknown}")
        return {key: self._image(key, images[key]) for key in self.cameras}

    def _image(self, key: str, value: Any) -> np.ndarray:
        name = f"images['{key}']"
        array = _array(name, value)
        if array.ndim != 3 or (array.shape[-1] != 3 and array.shape[0] != 3):
            raise RequestError(f"{name} has shape {list(array.shape)}; send {IMAGE_FORMS}")
        if array.dtype == np.uint8 and array.shape[-1] == 3:
            height, width = array.shape[:2]
        elif array.dtype.kind == "f" and array.shape[0] == 3:
            height, width = array.shape[1:]
            if not np.isfinite(array).all() or array.min(initial=0.0) < 0 or array.max(initial=0.0) > 1:
                raise RequestError(f"{name} holds values outside [0, 1] (or not finite); float images are in [0, 1]")
        else:
            raise RequestError(f"{name} is {list(array.shape)} {array.dtype}; send {IMAGE_FORMS}")
        low, high = self.image_sides()
        if min(height, width) < low or max(height, width) > high:
            raise RequestError(f"{name} is {height}x{width} px; the policy takes sides of {low} to {high} px (it "
                               f"resizes each camera to {self.image_size}x{self.image_size})")
        return array.astype(array.dtype.newbyteorder("="), copy=False)  # torch reads native byte order only


def _array(name: str, value: Any) -> np.ndarray:
    """``value`` as an array: a numpy array as decoded, or (nested) lists as numpy reads them."""
    if isinstance(value, np.ndarray):
        return value
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as err:  # ragged nested lists
        raise RequestError(f"{name} is not an array ({' '.join(str(err).split())})") from None
