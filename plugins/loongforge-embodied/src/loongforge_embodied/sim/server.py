"""Serve a policy checkpoint over a websocket, so a simulator or robot in another process (or language) can ask
it for action chunks: ``loongforge serve CKPT --host 127.0.0.1 --port 8765``.

The messages are in :mod:`loongforge_embodied.sim.protocol` (metadata on connect, then request -> ``{"actions"}``
or ``{"error"}``). Each connection is served on its own thread; one lock runs one chunk at a time, so several
clients share the CPU/GPU in turn and get the same numbers as a single client would.
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import Server, ServerConnection, serve

from loongforge_embodied.sim.protocol import pack, unpack

#: Largest message accepted (camera images included).
MAX_MESSAGE_BYTES = 64 * 2**20
log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the server cannot answer; its text goes back to the client as ``{"error": ...}``."""


def parse_request(message: Mapping[str, Any], metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Check a request against the policy's metadata; returns ``task``, ``state``, ``images``, ``seed``."""
    unknown = sorted(set(message) - {"task", "state", "images", "seed"})
    if unknown:
        raise RequestError(f"unknown request keys {unknown}; send task, state, images (optional), seed (optional)")
    if not isinstance(message.get("task"), str):
        raise RequestError("'task' must be the instruction text (a string)")
    if "state" not in message:
        raise RequestError("'state' is missing (the robot state in the dataset's units)")
    try:
        state = np.asarray(message["state"], dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise RequestError(f"'state' is not a numeric vector: {err}") from None
    expected = metadata.get("state_dim")
    if state.ndim != 1 or (expected is not None and state.shape[0] != expected):
        raise RequestError(f"'state' has shape {list(state.shape)}; the policy takes a vector of {expected}")
    images = message.get("images") or {}
    if not isinstance(images, dict):
        raise RequestError("'images' must map camera keys to arrays")
    missing = sorted(set(metadata.get("cameras") or []) - set(images))
    if missing:
        raise RequestError(f"'images' lacks cameras {missing}; the policy takes {metadata['cameras']}")
    seed = message.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise RequestError(f"'seed' must be an integer, got {seed!r}")
    return {"task": message["task"], "state": state, "images": {k: np.asarray(v) for k, v in images.items()},
            "seed": seed}


class PolicyHandler:
    """Answers one connection at a time per thread; ``policy`` has ``metadata`` and ``act(...)``."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self._lock = threading.Lock()

    def __call__(self, connection: ServerConnection) -> None:
        connection.send(pack(self.policy.metadata))
        try:
            for data in connection:
                connection.send(pack(self.answer(data)))
        except ConnectionClosed:
            pass

    def answer(self, data: bytes | str) -> dict[str, Any]:
        """The reply to one raw message: actions, or an error that says what was wrong."""
        try:
            request = parse_request(unpack(data), self.policy.metadata)
        except ValueError as err:  # RequestError included
            return {"error": str(err)}
        try:
            with self._lock:
                actions = self.policy.act(request["task"], request["state"], request["images"], seed=request["seed"])
        except Exception as err:  # the policy's failure is the client's answer, not the server's end
            log.exception("policy failed on a request")
            return {"error": f"the policy failed: {type(err).__name__}: {err}"}
        return {"actions": np.asarray(actions, dtype=np.float64).tolist()}


def make_server(policy: Any, host: str = "127.0.0.1", port: int = 8765) -> Server:
    """A bound server (``port=0`` picks a free one, see ``server.socket.getsockname()``); call ``serve_forever``."""
    return serve(PolicyHandler(policy), host, port, max_size=MAX_MESSAGE_BYTES, compression=None)


def configure(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``loongforge serve`` (and of ``python -m``)."""
    parser.add_argument("checkpoint", help="a checkpoint directory, or a checkpoint root (its latest)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--steps", type=int, default=10, help="Euler steps per action chunk")


def run(args: argparse.Namespace) -> int:
    """``loongforge serve``: serve until Ctrl-C."""
    from loongforge_embodied.sim.policy import CheckpointPolicy

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    policy = CheckpointPolicy(args.checkpoint, steps=args.steps)
    with make_server(policy, args.host, args.port) as server:
        host, port = server.socket.getsockname()[:2]
        meta = policy.metadata
        print(f"serving {meta['model']} from {policy.path} on ws://{host}:{port} (actions {meta['horizon']} x "
              f"{meta['action_dim']}, state {meta['state_dim']}, cameras {meta['cameras']}); Ctrl-C stops",
              flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loongforge_embodied.sim.server``, kept for old scripts; ``loongforge serve`` is the documented
    way."""
    parser = argparse.ArgumentParser(description="serve a policy checkpoint over a websocket (msgpack messages)")
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
