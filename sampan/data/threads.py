"""Running a producer ahead of its consumer in a background thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def prefetch(it: Iterator[T], depth: int = 2, name: str = "sampan-prefetch") -> Iterator[T]:
    """Yield the items of ``it``, produced up to ``depth`` ahead in a background thread.

    Pays when producing releases the GIL (Arrow parsing, NumPy gathers). An exception in the
    producer is re-raised in the consumer; leaving the loop early stops the producer.

    >>> list(prefetch(iter(range(5))))
    [0, 1, 2, 3, 4]
    """
    q: queue.Queue[Any] = queue.Queue(maxsize=max(depth, 1))
    done = object()
    stop = threading.Event()

    def put(x: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for x in it:
                if not put(x):
                    return
        except BaseException as e:  # re-raised in the consumer
            put(e)
            return
        put(done)

    t = threading.Thread(target=work, daemon=True, name=name)
    t.start()
    try:
        while True:
            x = q.get()
            if x is done:
                return
            if isinstance(x, BaseException):
                raise x
            yield x
    finally:
        stop.set()
        t.join()
