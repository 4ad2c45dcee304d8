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
- **connections**: at most ``max_connections`` are served at once, and at most ``max_connections_per_client``
  from one address (by default as many as the total: set it when clients on several machines share a server, so
  that one of them cannot take every slot). One more is *refused*, not queued: it gets ``{"error": ...}`` in place
  of the metadata and is closed with 1013 (try again later). A robot's control loop is better served by an
  immediate error it can act on than by a socket that silently waits for a slot, and a queue would itself be
  memory an unbounded number of clients could fill. Dead peers free their slot through websockets' keepalive
  pings; live but *idle* ones through ``idle_timeout_s``: a connection that sends no request for that long (after
  the metadata, or after its last answer) is closed with 1000 and the reason, so a client that connected and went
  quiet cannot hold a slot for ever. A client that hangs up during or right after the handshake is no error: the
  slot comes free with nothing logged above debug level.
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
#: Seconds a connection may go without a request before it is closed, unless ``--idle-timeout-s`` says otherwise.
DEFAULT_IDLE_TIMEOUT_S = 120.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """What one server accepts (see the module docstring); sent to clients under ``limits`` in the metadata."""

    #: Largest incoming message in bytes, checked from each frame's length header before its body is read.
    max_message_bytes: int
    #: Connections served at once; one more is refused with an error message (not queued).
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: Connections served at once from one client address (``None``: up to ``max_connections``).
    max_connections_per_client: int | None = None
    #: Seconds without a request after which a connection is closed (its slot freed).
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S

    def __post_init__(self) -> None:
        per_client = self.max_connections_per_client
        if self.max_message_bytes < 1 or self.max_connections < 1 or (per_client is not None and per_client < 1) \
                or not 0 < self.idle_timeout_s < float("inf"):
            raise ValueError(f"server limits must be positive, got {self}")

    @property
    def per_client(self) -> int:
        """Connections one client address may hold."""
        return min(self.max_connections, self.max_connections_per_client or self.max_connections)

    @classmethod
    def for_policy(cls, metadata: dict[str, Any], *, max_message_bytes: int | None = None,
                   max_connections: int = DEFAULT_MAX_CONNECTIONS, max_connections_per_client: int | None = None,
                   idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S) -> ServerLimits:
        """The limits for a policy: ``max_message_bytes`` defaults to what its observation schema implies."""
        if max_message_bytes is None:
            max_message_bytes = ObservationSchema.from_metadata(metadata).default_message_bytes()
        return cls(max_message_bytes, max_connections, max_connections_per_client, idle_timeout_s)


class PolicyHandler:
    """Serves each connection on its thread; ``policy`` has ``metadata`` and ``act(...)``."""

    def __init__(self, policy: Any, limits: ServerLimits) -> None:
        self.policy, self.limits = policy, limits
        self.schema = ObservationSchema.from_metadata(policy.metadata)
        limits_meta: dict[str, Any] = {"max_message_bytes": limits.max_message_bytes,
                                       "max_connections": limits.max_connections,
                                       "max_connections_per_client": limits.per_client,
                                       "idle_timeout_s": limits.idle_timeout_s}
        if self.schema.cameras:
            limits_meta["image_sides"] = list(self.schema.image_sides())
        self.metadata = {**policy.metadata, "limits": limits_meta}
        self._lock = threading.Lock()
        #: Connections being served, in all and by client address (under ``_count_lock``).
        self._count_lock = threading.Lock()
        self._serving = 0
        self._by_client: dict[str, int] = {}

    def __call__(self, connection: ServerConnection) -> None:
        peer = _peer(connection)  # read now: the socket may be gone by the time a message is logged
        if peer is None:  # the client hung up during or right after the handshake: nothing to serve
            log.debug("a client closed its connection before it was served")
            return
        client = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        refused = self._take_slot(client)
        if refused is not None:
            self._refuse(connection, peer, refused)
            return
        try:
            connection.send(pack(self.metadata))
            self._serve(connection, peer)
        except ConnectionClosed as closed:
            if closed.sent is not None and closed.sent.code == CloseCode.MESSAGE_TOO_BIG:
                log.warning("closed the connection from %s: %s", peer, closed.sent.reason)
        except OSError as err:  # the socket went away under a send (a client that vanished): its slot comes free
            log.debug("the connection from %s broke: %s", peer, err)
        finally:
            self._free_slot(client)

    def _serve(self, connection: ServerConnection, peer: Any) -> None:
        """Answer requests until the client closes, or sends none for ``idle_timeout_s``."""
        idle = self.limits.idle_timeout_s
        while True:
            try:
                data = connection.recv(timeout=idle)
            except TimeoutError:
                log.info("closed the connection from %s: no request for %g s (--idle-timeout-s)", peer, idle)
                connection.close(CloseCode.NORMAL_CLOSURE, f"idle for {idle:g} s (the server's --idle-timeout-s)")
                return
            connection.send(pack(self.answer(data)))

    def _take_slot(self, client: str) -> str | None:
        """Count one more connection from ``client``; the refusal's reason when a limit is reached instead."""
        with self._count_lock:
            if self._serving >= self.limits.max_connections:
                return (f"the server already serves its limit of {self.limits.max_connections} connection(s) "
                        "(loongforge serve --max-connections); retry later")
            if self._by_client.get(client, 0) >= self.limits.per_client:
                return (f"the server already serves {self.limits.per_client} connection(s) from {client}, its limit "
                        "per client (loongforge serve --max-connections-per-client); retry later")
            self._serving += 1
            self._by_client[client] = self._by_client.get(client, 0) + 1
            return None

    def _free_slot(self, client: str) -> None:
        with self._count_lock:
            self._serving -= 1
            self._by_client[client] -= 1
            if not self._by_client[client]:
                del self._by_client[client]

    def _refuse(self, connection: ServerConnection, peer: Any, reason: str) -> None:
        log.warning("refused a connection from %s: %s", peer, reason)
        try:
            connection.send(pack({"error": reason}))
            connection.close(CloseCode.TRY_AGAIN_LATER, "too many connections")
        except (ConnectionClosed, OSError):
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


def _peer(connection: ServerConnection) -> Any:
    """The client's address, or ``None`` when its socket is already gone (websockets reads it from the socket,
    which raises EBADF or ENOTCONN once the client hung up and the server closed its end)."""
    try:
        return connection.remote_address
    except OSError:
        return None


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
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8765, help="port to listen on (default 8765)")
    parser.add_argument("--steps", type=int, default=10, help="Euler steps per action chunk")
    parser.add_argument("--max-message-mb", type=_positive(float), default=None, metavar="MIB",
                        help="largest request accepted, in MiB; a frame announcing more is refused before its body "
                             "is read and the connection closed (1009). Default: 8 x the policy's observation at its "
                             "own image size as float32, plus 64 KiB (13.8 MiB for three 224 px cameras)")
    parser.add_argument("--max-connections", type=_positive(int), default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                        help="connections served at once; one more gets an error message and is closed (1013, "
                             f"try again later), not queued (default {DEFAULT_MAX_CONNECTIONS})")
    parser.add_argument("--max-connections-per-client", type=_positive(int), default=None, metavar="N",
                        help="connections served at once from one client address; one more is refused the same "
                             "way (default: up to --max-connections)")
    parser.add_argument("--idle-timeout-s", type=_positive(float), default=DEFAULT_IDLE_TIMEOUT_S, metavar="S",
                        help="close a connection that sends no request for S seconds, freeing its slot (code 1000 "
                             f"and the reason; default {DEFAULT_IDLE_TIMEOUT_S:g})")
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
        max_connections_per_client=args.max_connections_per_client, idle_timeout_s=args.idle_timeout_s,
        max_message_bytes=None if args.max_message_mb is None else max(1, int(args.max_message_mb * 2**20)))
    with make_server(policy, args.host, args.port, limits) as server:
        host, port = server.socket.getsockname()[:2]
        meta = policy.metadata
        print(f"serving {meta['model']} from {policy.path} on ws://{host}:{port} (actions {meta['horizon']} x "
              f"{meta['action_dim']}, state {meta['state_dim']}, cameras {meta['cameras']}; requests up to "
              f"{limits.max_message_bytes / 2**20:.2f} MiB, {limits.max_connections} connection(s) at once, "
              f"{limits.per_client} per client, closed after {limits.idle_timeout_s:g} s idle); Ctrl-C stops",
              flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":  # the old front-end: say where it went rather than exit 0 having done nothing
    raise SystemExit("python -m loongforge_embodied.sim.server is now `loongforge serve CHECKPOINT ...`")
