"""One micro-batch stream fed to every model chunk of an interleaved (virtual) pipeline.

Why: megatron's interleaved schedule takes one data iterator per model chunk and calls ``next`` on chunk
``i``'s iterator each time chunk ``i`` runs a micro-batch forward, in an order that interleaves the chunks.
Every chunk must see the *same* micro-batches (the first chunk needs the tokens, the last the labels), and
the run's iterator must advance once per micro-batch so its position (what checkpoints store) stays the
same as without virtual stages. Each feed below therefore pulls a micro-batch from the source when it is the
first to need it and leaves a copy for the others; at a step boundary every chunk has consumed the same
micro-batches, so nothing is buffered between steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any


def chunk_feeds(source: Iterator[Any], num_chunks: int) -> list[Iterator[Any]]:
    """``num_chunks`` iterators that each yield the items of ``source`` in order, reading it once."""
    queues: list[deque[Any]] = [deque() for _ in range(num_chunks)]

    def feed(index: int) -> Iterator[Any]:
        while True:
            if not queues[index]:
                item = next(source)
                for queue in queues:
                    queue.append(item)
            yield queues[index].popleft()

    return [feed(i) for i in range(num_chunks)]
