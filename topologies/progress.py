"""Progress of a long command, with an honest ETA: one line per finished unit of work (a run,
a simulated seed, a sweep value) on standard error, the same on a terminal and in a log.

The ETA is the pace so far times what is left, so it is only as good as the units are alike;
it says nothing until one unit is done. Shared by ``dlcp run``, ``dlcp sweep``, ``dlcp sim``
(and its sweeps) and ``dlcp converge``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def eta(elapsed: float, done: int, total: int) -> str:
    """``", about 12 min left"`` from the pace so far; empty when nothing or everything is done."""
    if done >= total or done == 0:
        return ""
    left = elapsed / done * (total - done)
    return f", about {left / 60:.0f} min left" if left >= 90 else f", about {left:.0f} s left"


def duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


class Progress:
    """Counts finished units out of ``total`` and prints ``[k/total] what (took, elapsed, ETA)``.

    ``clock`` is injectable so a test runs on a fake one; ``stream=None`` prints nothing (a
    quiet run); the default is whatever ``sys.stderr`` is when a line is printed.
    ``prefix`` goes before each line's ``what`` (a sweep sets it to the value)."""

    def __init__(self, total: int, stream: TextIO | None | str = "stderr",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.done = 0
        self.stream = stream
        self.clock = clock
        self.started = self.last = clock()
        self.prefix = ""

    def step(self, what: str) -> str:
        """One more unit finished; returns (and prints) its line."""
        now = self.clock()
        self.done += 1
        line = (f"[{self.done}/{self.total}] {self.prefix}{what} ({duration(now - self.last)}; "
                f"{duration(now - self.started)} in all{eta(now - self.started, self.done, self.total)})")
        self.last = now
        if self.stream is not None:
            print(line, file=sys.stderr if isinstance(self.stream, str) else self.stream, flush=True)
        return line
