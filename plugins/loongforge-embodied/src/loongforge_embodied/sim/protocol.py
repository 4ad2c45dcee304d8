"""Wire format between a policy server and its clients: msgpack messages over a websocket.

Every message is one binary websocket frame holding one msgpack map (strings UTF-8, byte strings as msgpack
``bin``). Numpy arrays travel as a map ``{"__ndarray__": true, "dtype": "<f4", "shape": [H, W, 3], "data": <bin>}``:
``dtype`` is numpy's dtype string (byte order included), ``data`` the array's C-order bytes. Any client can
build one without numpy; plain (nested) lists are accepted wherever an array is.

The conversation:

1. on connect the server sends its metadata: ``{"type": "metadata", "protocol": 1, "action_dim": A,
   "horizon": H, "state_dim": D, "cameras": [keys...], "image_size": S, "model": name, "limits":
   {"max_message_bytes": N, "max_connections": C, "image_sides": [min, max] (with cameras)}}`` -- or, when it
   already serves ``C`` connections, ``{"error": ...}`` and closes the connection (code 1013, try again later);
2. the client sends requests ``{"task": str, "state": array (D,) of finite numbers in the dataset's units,
   "images": {camera key: (H, W, 3) uint8 or (3, H, W) float in [0, 1], sides within image_sides} (every
   camera, no other key; omitted without cameras), "seed": int >= 0 (optional, default 0: the sampling noise)}``,
   each at most ``max_message_bytes`` (a larger one is refused from its frame header and the connection closed,
   code 1009);
3. the server answers each with ``{"actions": [[a_1 ... a_A] x H]}`` (lists of floats, the dataset's units) or,
   when the request was wrong or the policy failed, ``{"error": "what was wrong"}``; the connection stays open.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

PROTOCOL = 1
NDARRAY = "__ndarray__"


def pack(message: dict[str, Any]) -> bytes:
    """``message`` as msgpack bytes; numpy arrays become the ``__ndarray__`` map, numpy scalars Python numbers."""
    return msgpack.packb(message, default=_encode, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    """A received message; ``__ndarray__`` maps come back as numpy arrays. Raises ``ValueError`` on bad bytes."""
    if not isinstance(data, bytes):
        raise ValueError("expected a binary websocket message holding msgpack, got text")
    try:
        message = msgpack.unpackb(data, object_hook=_decode, raw=False)
    except (msgpack.UnpackException, ValueError, TypeError) as err:
        raise ValueError(f"not a valid msgpack message ({err})") from None
    if not isinstance(message, dict):
        raise ValueError(f"a message must be a msgpack map, got {type(message).__name__}")
    return message


def _encode(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        return {NDARRAY: True, "dtype": array.dtype.str, "shape": list(array.shape), "data": array.tobytes()}
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot send a {type(value).__name__} (send numbers, strings, lists, dicts or numpy arrays)")


def _decode(value: dict[str, Any]) -> Any:
    if not value.get(NDARRAY):
        return value
    try:
        dtype = np.dtype(value["dtype"])
        if dtype.hasobject:
            raise ValueError("object arrays are not allowed")
        return np.frombuffer(value["data"], dtype=dtype).reshape(value["shape"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"bad {NDARRAY} map (needs dtype, shape and data of matching size): {err}") from None
