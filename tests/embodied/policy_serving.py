"""A policy server on a free local port for the length of a ``with`` block, for the tests that talk to one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from loongforge_embodied.sim.server import make_server


@contextmanager
def serving(policy, limits=None) -> Iterator[str]:
    """A server for ``policy`` (with ``limits``, else the policy's defaults); yields its ws:// url."""
    server = make_server(policy, "127.0.0.1", 0, limits)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"ws://127.0.0.1:{server.socket.getsockname()[1]}"
    finally:
        server.shutdown()
        thread.join(timeout=10)
