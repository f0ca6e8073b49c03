"""Progress on stderr for steps that may run long: silent for the first PROGRESS_AFTER_S seconds, then a bar
on a terminal (redrawn in place) or a line per quarter in a log; thread-safe (the fill threads share one)."""

from __future__ import annotations

import sys
import threading
import time

PROGRESS_AFTER_S = 2.0


class Progress:
    """``add(n)`` as work is done, of ``total`` (bytes: the rate is shown in GB/s; else counted in ``unit``);
    ``finish()`` ends the bar's line."""

    def __init__(self, total: int, label: str, unit: str = "bytes"):
        self.total, self.label, self.unit = total, label, unit
        self.done = 0
        self.start = time.monotonic()
        self.lock = threading.Lock()
        self.shown = False
        self.tty = sys.stderr.isatty()
        self.next_quarter = 0.25  # without a terminal: one line per quarter

    def add(self, n: int = 1) -> None:
        with self.lock:
            self.done += n
            elapsed = time.monotonic() - self.start
            if elapsed < PROGRESS_AFTER_S:
                return
            frac = self.done / self.total if self.total else 1.0
            amount = (f"{self.done / elapsed / 1e9:5.2f} GB/s" if self.unit == "bytes"
                      else f"{self.done} of {self.total} {self.unit}")
            if self.tty:
                self.shown = True
                sys.stderr.write(f"\r{self.label} [{'#' * int(30 * frac):<30}] {frac:6.1%} {amount}")
            elif frac >= self.next_quarter:
                sys.stderr.write(f"{self.label}: {frac:.0%} {amount}, {elapsed:.0f} s\n")
                self.next_quarter = int(frac * 4) / 4 + 0.25
            sys.stderr.flush()

    def finish(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            self.shown = False
