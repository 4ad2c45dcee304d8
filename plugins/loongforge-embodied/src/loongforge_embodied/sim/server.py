"""Serve a policy checkpoint over a websocket, so a simulator or robot in another process (or language) can ask
it for action chunks: ``loongforge serve CKPT --host 127.0.0.1 --port 8765``.

The messages are in :mod:`loongforge_embodied.sim.protocol` (metadata on connect, then request -> ``{"actions"}``
or ``{"error"}``). Each connection is served on its own thread; one lock runs one chunk at a time, so several
clients share the CPU/GPU in turn and get the same numbers as a single client would.

What one client can cost the server is bounded (:class:`ServerLimits`, sent to clients in the metadata):

- **message size**: a frame whose length header announces more than ``max_message_bytes`` (or a message whose
  fragments add up to more) is refused before its body is read -- websockets checks the header against the limit
  -- and the connection is closed with code 1009 and the sizes as the reason. The default is derived from the
  policy's observation (:meth:`~loongforge_embodied.sim.observation.ObservationSchema.default_message_bytes`).
  Each connection also buffers at most one incoming frame ahead of the one being answered.
- **connections**: at most ``max_connections`` are served at once. One more is *refused*, not queued: it gets
  ``{"error": ...}`` in place of the metadata and is closed with 1013 (try again later). A robot's control loop
  is better served by an immediate error it can act on than by a socket that silently waits for a slot, and a
  queue would itself be memory an unbounded number of clients could fill. Dead peers free their slot through
  websockets' keepalive pings.
- **content**: every request is checked against the policy's schema (:mod:`~loongforge_embodied.sim.observation`:
  state length and finiteness, cameras, image dtype/shape/size, task and seed types); a wrong one is answered with
  ``{"error": ...}`` and the connection stays usable.
"""

from __future__ import annotations

import argparse
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
from loongforge.commands import add_trust_code_option
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode
from websockets.sync.server import Server, ServerConnection, serve

from loongforge_embodied.sim.observation import ObservationSchema
from loongforge_embodied.sim.protocol import pack, unpack

#: Connections served at once unless ``--max-connections`` says otherwise.
DEFAULT_MAX_CONNECTIONS = 4
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """What one server accepts (see the module docstring); sent to clients under ``limits`` in the metadata."""

    #: Largest incoming message in bytes, checked from each frame's length header before its body is read.
    max_message_bytes: int
    #: Connections served at once; one more is refused with an error message (not queued).
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1 or self.max_connections < 1:
            raise ValueError(f"server limits must be positive, got {self}")

    @classmethod
    def for_policy(cls, metadata: dict[str, Any], *, max_message_bytes: int | None = None,
                   max_connections: int = DEFAULT_MAX_CONNECTIONS) -> ServerLimits:
        """The limits for a policy: ``max_message_bytes`` defaults to what its observation schema implies."""
        if max_message_bytes is None:
            max_message_bytes = ObservationSchema.from_metadata(metadata).default_message_bytes()
        return cls(max_message_bytes, max_connections)


class PolicyHandler:
    """Serves each connection on its thread; ``policy`` has ``metadata`` and ``act(...)``."""

    def __init__(self, policy: Any, limits: ServerLimits) -> None:
        self.policy, self.limits = policy, limits
        self.schema = ObservationSchema.from_metadata(policy.metadata)
        limits_meta: dict[str, Any] = {"max_message_bytes": limits.max_message_bytes,
                                       "max_connections": limits.max_connections}
        if self.schema.cameras:
            limits_meta["image_sides"] = list(self.schema.image_sides())
        self.metadata = {**policy.metadata, "limits": limits_meta}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(limits.max_connections)

    def __call__(self, connection: ServerConnection) -> None:
        peer = connection.remote_address  # read now: the socket may be gone by the time a message is logged
        if not self._slots.acquire(blocking=False):
            self._refuse(connection, peer)
            return
        try:
            connection.send(pack(self.metadata))
            for data in connection:
                connection.send(pack(self.answer(data)))
        except ConnectionClosed as closed:
            if closed.sent is not None and closed.sent.code == CloseCode.MESSAGE_TOO_BIG:
                log.warning("closed the connection from %s: %s", peer, closed.sent.reason)
        finally:
            self._slots.release()

    def _refuse(self, connection: ServerConnection, peer: Any) -> None:
        most = self.limits.max_connections
        log.warning("refused a connection from %s: already serving %d", peer, most)
        try:
            connection.send(pack({"error": f"the server already serves its limit of {most} connection(s) "
                                           "(loongforge serve --max-connections); retry later"}))
            connection.close(CloseCode.TRY_AGAIN_LATER, "too many connections")
        except ConnectionClosed:
            pass

    def answer(self, data: bytes | str) -> dict[str, Any]:
        """The reply to one raw message: actions, or an error that says what was wrong."""
        try:
            request = self.schema.parse(unpack(data))
        except ValueError as err:  # RequestError, and protocol errors of unpack
            return {"error": str(err)}
        try:
            with self._lock:
                actions = self.policy.act(request["task"], request["state"], request["images"], seed=request["seed"])
        except Exception as err:  # the policy's failure is the client's answer, not the server's end
            log.exception("policy failed on a request")
            return {"error": f"the policy failed: {type(err).__name__}: {err}"}
        return {"actions": np.asarray(actions, dtype=np.float64).tolist()}


def make_server(policy: Any, host: str = "127.0.0.1", port: int = 8765, limits: ServerLimits | None = None) -> Server:
    """A bound server (``port=0`` picks a free one, see ``server.socket.getsockname()``); call ``serve_forever``.
    ``limits`` default to :meth:`ServerLimits.for_policy`."""
    limits = limits or ServerLimits.for_policy(policy.metadata)
    # max_queue=1: at most one frame is buffered ahead of the request being answered (websockets' default is 16)
    return serve(PolicyHandler(policy, limits), host, port, max_size=limits.max_message_bytes, max_queue=1,
                 compression=None)


def configure(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``loongforge serve``."""
    parser.add_argument("checkpoint", help="a checkpoint directory, or a checkpoint root (its latest)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--steps", type=int, default=10, help="Euler steps per action chunk")
    parser.add_argument("--max-message-mb", type=_positive(float), default=None, metavar="MIB",
                        help="largest request accepted, in MiB; a frame announcing more is refused before its body "
                             "is read and the connection closed (1009). Default: 8 x the policy's observation at its "
                             "own image size as float32, plus 64 KiB (13.8 MiB for three 224 px cameras)")
    parser.add_argument("--max-connections", type=_positive(int), default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                        help="connections served at once; one more gets an error message and is closed (1013, "
                             f"try again later), not queued (default {DEFAULT_MAX_CONNECTIONS})")
    add_trust_code_option(parser)


def _positive(kind: type) -> Any:
    """An argparse ``type`` accepting numbers of ``kind`` above zero."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
        return value

    return parse


def run(args: argparse.Namespace) -> int:
    """``loongforge serve``: serve until Ctrl-C."""
    from loongforge_embodied.sim.policy import CheckpointPolicy

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    policy = CheckpointPolicy(args.checkpoint, steps=args.steps, trust_code=args.trust_code)
    limits = ServerLimits.for_policy(
        policy.metadata, max_connections=args.max_connections,
        max_message_bytes=None if args.max_message_mb is None else max(1, int(args.max_message_mb * 2**20)))
    with make_server(policy, args.host, args.port, limits) as server:
        host, port = server.socket.getsockname()[:2]
        meta = policy.metadata
        print(f"serving {meta['model']} from {policy.path} on ws://{host}:{port} (actions {meta['horizon']} x "
              f"{meta['action_dim']}, state {meta['state_dim']}, cameras {meta['cameras']}; requests up to "
              f"{limits.max_message_bytes / 2**20:.2f} MiB, {limits.max_connections} connection(s) at once); "
              "Ctrl-C stops", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":  # the old front-end: say where it went rather than exit 0 having done nothing
    raise SystemExit("python -m loongforge_embodied.sim.server is now `loongforge serve CHECKPOINT ...`")
