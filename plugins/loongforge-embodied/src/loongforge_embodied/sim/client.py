"""``PolicyClient``: ask a policy server (:mod:`loongforge_embodied.sim.server`) for action chunks.

It acts like an in-process policy (``metadata``, ``act(task, state, images, seed=...)``), so the evaluator runs
the same loop against either. Arrays are sent in the protocol's ``__ndarray__`` form, keeping their dtype, so the
server sees exactly the numbers the caller has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from websockets.sync.client import connect

from loongforge_embodied.sim.protocol import PROTOCOL, pack, unpack
from loongforge_embodied.sim.server import MAX_MESSAGE_BYTES


class PolicyServerError(RuntimeError):
    """The server answered a request with an error message."""


class PolicyClient:
    """A connection to a policy server at ``url`` (``ws://host:port``); use as a context manager or ``close()``."""

    def __init__(self, url: str, *, timeout: float = 60.0) -> None:
        self.url, self.timeout = url, timeout
        # entered as a context manager (what websockets >= 17.1 asks for); close() leaves it
        self._connection = connect(url, max_size=MAX_MESSAGE_BYTES, compression=None, open_timeout=timeout).__enter__()
        self.metadata: dict[str, Any] = unpack(self._connection.recv(timeout=timeout))
        if self.metadata.get("type") != "metadata" or self.metadata.get("protocol") != PROTOCOL:
            self.close()
            raise PolicyServerError(f"{url} did not start with protocol {PROTOCOL} metadata: {self.metadata}")

    def act(self, task: str, state: np.ndarray, images: Mapping[str, np.ndarray] | None = None, *,
            seed: int = 0) -> np.ndarray:
        """One (H, A) float64 action chunk for one observation."""
        request: dict[str, Any] = {"task": task, "state": np.asarray(state), "seed": int(seed)}
        if images:
            request["images"] = {key: np.asarray(value) for key, value in images.items()}
        self._connection.send(pack(request))
        reply = unpack(self._connection.recv(timeout=self.timeout))
        if "error" in reply:
            raise PolicyServerError(f"{self.url}: {reply['error']}")
        return np.asarray(reply["actions"], dtype=np.float64)

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
