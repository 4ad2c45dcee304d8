"""``PolicyClient``: ask a policy server (:mod:`loongforge_embodied.sim.server`) for action chunks.

It acts like an in-process policy (``metadata``, ``act(task, state, images, seed=...)``), so the evaluator runs
the same loop against either. Arrays are sent in the protocol's ``__ndarray__`` form, keeping their dtype, so the
server sees exactly the numbers the caller has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from loongforge.errors import LoongForgeError
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.sync.client import connect

from loongforge_embodied.sim.policy import act_each
from loongforge_embodied.sim.protocol import PROTOCOL, pack, unpack

#: Largest reply accepted (metadata, an action chunk: kilobytes).
MAX_REPLY_BYTES = 16 * 2**20


class PolicyServerError(LoongForgeError, RuntimeError):
    """The server answered with an error message, refused the connection, was not reachable, or closed it (the
    reason is given; ``loongforge eval ws://...`` prints it as one line)."""


class PolicyClient:
    """A connection to a policy server at ``url`` (``ws://host:port``); use as a context manager or ``close()``.

    A server at its connection limit answers with an error instead of its metadata, and one that closes the
    connection (a request over its size limit) gives its close code and reason: both raise
    :class:`PolicyServerError` with the server's words. A request larger than the limit the server announced in
    its metadata is refused here, before it is sent."""

    #: The server's messages carry actions only, so no imagined frames come back.
    predicted_frames = None

    def __init__(self, url: str, *, timeout: float = 60.0) -> None:
        self.url, self.timeout = url, timeout
        # entered as a context manager (what websockets >= 17.1 asks for); close() leaves it
        try:
            self._connection = connect(url, max_size=MAX_REPLY_BYTES, compression=None,
                                       open_timeout=timeout).__enter__()
        except (OSError, InvalidURI, InvalidHandshake) as err:  # refused, unresolvable, not a websocket server
            raise PolicyServerError(f"cannot connect to the policy server at {url}: {err}") from None
        try:
            self.metadata: dict[str, Any] = self._receive()
        except PolicyServerError:  # refused: the server is at its connection limit
            self.close()
            raise
        if self.metadata.get("type") != "metadata" or self.metadata.get("protocol") != PROTOCOL:
            self.close()
            raise PolicyServerError(f"{url} did not start with protocol {PROTOCOL} metadata: {self.metadata}")

    def act(self, task: str, state: np.ndarray, images: Mapping[str, np.ndarray] | None = None, *,
            seed: int = 0) -> np.ndarray:
        """One (H, A) float64 action chunk for one observation."""
        request: dict[str, Any] = {"task": task, "state": np.asarray(state), "seed": int(seed)}
        if images:
            request["images"] = {key: np.asarray(value) for key, value in images.items()}
        data = pack(request)
        limit = self.metadata.get("limits", {}).get("max_message_bytes")
        if limit is not None and len(data) > limit:
            raise PolicyServerError(f"{self.url}: the request is {len(data)} bytes, over the server's limit of {limit} "
                                    "(send smaller or uint8 images, or raise loongforge serve --max-message-mb)")
        try:
            self._connection.send(data)
        except ConnectionClosed as closed:
            raise self._closed(closed) from None
        return np.asarray(self._receive()["actions"], dtype=np.float64)

    def act_batch(self, task: str, states: np.ndarray, images: Sequence[Mapping[str, np.ndarray]],
                  seeds: Sequence[int]) -> np.ndarray:
        """(E, H, A) chunks, one request per observation (the protocol carries one observation a request; the
        server batches nothing, so this costs what E ``act`` calls cost)."""
        return act_each(self.act, task, states, images, seeds)

    def _receive(self) -> dict[str, Any]:
        """The next message; a server error or a closed connection raises :class:`PolicyServerError`."""
        try:
            reply = unpack(self._connection.recv(timeout=self.timeout))
        except ConnectionClosed as closed:
            raise self._closed(closed) from None
        if "error" in reply:
            raise PolicyServerError(f"{self.url}: {reply['error']}")
        return reply

    def _closed(self, closed: ConnectionClosed) -> PolicyServerError:
        close = closed.rcvd or closed.sent
        why = f"code {close.code}: {close.reason or 'no reason given'}" if close else "no close frame"
        return PolicyServerError(f"{self.url}: the server closed the connection ({why})")

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
