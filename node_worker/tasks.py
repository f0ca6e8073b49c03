"""A node's threads: pinned one per CPU, taking tasks from the node's own counter
and meeting at the node's own barrier.

``run(n, fn)`` calls ``fn(i)`` for every task index ``i < n`` on the node's
threads and returns the results in index order, so what the caller does with
them does not depend on which thread ran what, or when.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import Callable, Sequence

log = logging.getLogger(__name__)


class TaskRunner:
    def __init__(self, threads: int = 1, cpus: Sequence[int] | None = None, name: str = "node"):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self.cpus = list(cpus or [])
        self._closed = False
        self._fn: Callable[[int], object] | None = None
        self._n = 0
        self._results: list = []
        self._errors: list[BaseException] = []
        self._counter = itertools.count()
        if threads > 1:
            # the caller is one of the workers; threads - 1 helpers join it
            self._start = threading.Barrier(threads)
            self._end = threading.Barrier(threads)
            self._helpers = [
                threading.Thread(target=self._helper, args=(k,), name=f"{name}-t{k}", daemon=True)
                for k in range(1, threads)
            ]
            for t in self._helpers:
                t.start()

    def _pin(self, k: int) -> None:
        if self.cpus:
            try:
                os.sched_setaffinity(0, {self.cpus[k % len(self.cpus)]})  # this thread only
            except OSError as exc:
                log.debug("thread %d not pinned: %s", k, exc)

    def _helper(self, k: int) -> None:
        self._pin(k)
        while True:
            self._start.wait()
            if self._closed:
                return
            self._drain()
            self._end.wait()

    def _drain(self) -> None:
        while True:
            i = next(self._counter)  # the node's counter: atomic under the GIL
            if i >= self._n:
                return
            try:
                self._results[i] = self._fn(i)
            except BaseException as exc:  # reported by run()
                self._errors.append(exc)

    def run(self, n: int, fn: Callable[[int], object]) -> list:
        self._fn, self._n = fn, n
        self._results = [None] * n
        self._errors = []
        self._counter = itertools.count()
        if self.threads == 1 or n <= 1:
            self._drain()
        else:
            self._start.wait()
            self._drain()
            self._end.wait()
        if self._errors:
            raise self._errors[0]
        return self._results

    def close(self) -> None:
        if self.threads > 1 and not self._closed:
            self._closed = True
            self._start.wait()
            for t in self._helpers:
                t.join(timeout=5)
