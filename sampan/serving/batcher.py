"""Micro-batching: concurrent requests share one model call.

Request handlers validate their own input (so errors go to the right caller) and submit the
validated table; a worker thread takes the first waiting table, gathers more for up to
``max_wait_ms`` or until ``max_batch_rows`` rows, scores them with one pipeline transform and
one graph call, and hands each request its slice. Tables validated by different predictors
(a reload in between) are never mixed in one call.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa


@dataclass
class _Item:
    predictor: Any
    table: pa.Table
    future: Future


class MicroBatcher:
    """``submit(predictor, table) -> Future[np.ndarray [rows, T]]``."""

    def __init__(self, max_batch_rows: int = 4096, max_wait_ms: float = 2.0,
                 on_batch: Callable[[int, int], None] | None = None):
        self.max_rows = max_batch_rows
        self.max_wait = max_wait_ms / 1000.0
        self.on_batch = on_batch  # (requests, rows) of every model call, for metrics
        self._q: queue.Queue[_Item | None] = queue.Queue()
        self._held: _Item | None = None
        self._thread = threading.Thread(target=self._run, name="sampan-batcher", daemon=True)
        self._thread.start()

    def submit(self, predictor: Any, table: pa.Table) -> Future:
        fut: Future = Future()
        self._q.put(_Item(predictor, table, fut))
        return fut

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)

    def _next(self, timeout: float | None) -> _Item | None:
        if self._held is not None:
            item, self._held = self._held, None
            return item
        return self._q.get(timeout=timeout) if timeout is None or timeout > 0 else \
            self._q.get_nowait()

    def _run(self) -> None:
        while True:
            first = self._next(None)
            if first is None:
                return
            try:
                self._gather_and_score(first)
            except Exception as e:  # noqa: BLE001 - never let the worker die
                if first.future.running():
                    first.future.set_exception(e)

    def _gather_and_score(self, first: _Item) -> None:
        items, rows = [first], first.table.num_rows
        deadline = time.perf_counter() + self.max_wait
        while rows < self.max_rows:
            try:
                item = self._next(deadline - time.perf_counter())
            except queue.Empty:
                break
            if item is None:
                self._q.put(None)  # close after this batch
                break
            if item.predictor is not first.predictor or \
                    rows + item.table.num_rows > self.max_rows:
                self._held = item  # starts the next batch
                break
            items.append(item)
            rows += item.table.num_rows
        # a request whose caller went away (cancelled) is dropped, not scored
        items = [i for i in items if i.future.set_running_or_notify_cancel()]
        if items:
            self._score(items)

    def _score(self, items: list[_Item]) -> None:
        rows = sum(i.table.num_rows for i in items)
        try:
            table = items[0].table if len(items) == 1 else pa.concat_tables(
                [i.table for i in items], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # e.g. a list feature sent two ways
            for i in items:
                self._score([i])
            return
        try:
            scores = items[0].predictor.score_table(table)
        except Exception as e:  # noqa: BLE001 - handed to every waiting request
            for i in items:
                i.future.set_exception(e)
            return
        if self.on_batch is not None:
            self.on_batch(len(items), rows)
        bounds = np.cumsum([0] + [i.table.num_rows for i in items])
        for i, lo, hi in zip(items, bounds[:-1], bounds[1:], strict=True):
            i.future.set_result(scores[lo:hi])
