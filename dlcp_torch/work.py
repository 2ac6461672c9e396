"""What a ``dlcp`` collective returns: a ``torch.distributed.Work`` that fails when its
collective fails.

Why not ``_create_work_from_future``: the work it makes returns True from ``wait()`` whatever
its future holds, and ``torch.futures.Future.set_exception`` stores the exception as the
future's *value* (only Python's ``wait()`` unwraps it). A failed collective then looked like a
success to ``dist.all_reduce`` (the tensor unchanged), and DDP's reducer, which reads the value
in C++, got an exception object where it wanted tensors (a crash, or "Unable to cast"). Here
``wait()`` raises the collective's error, and :meth:`DLCPWork.get_future` completes with a
C++-level error (it comes from a ``then`` callback that raises), which DDP's reducer and every
other C++ caller rethrow as a Python exception.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dlcp_torch.uncompiled import keep_out_of_compile


class DLCPWork(dist.Work):
    """One collective in flight. :meth:`finish` is called once, from the thread that ran it.

    Example::

        work = DLCPWork("all_reduce #3")
        work.finish(value=[tensor])          # or work.finish(error=exc)
        work.wait()                          # raises exc if it failed
    """

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._source: torch.futures.Future = torch.futures.Future()
        self._future = self._source.then(self._unwrap)

    def _unwrap(self, _: torch.futures.Future) -> Any:
        if self._error is not None:
            raise self._error
        return _future_value(self._value)

    def finish(self, value: Any = None, error: BaseException | None = None) -> None:
        """The collective ended: with ``value`` (what its future holds), or failed with ``error``.

        The future first (its callbacks run here), then the work, as gloo's works finish: once
        ``wait()`` returns, ``get_future().done()`` is True (the other order left a window where
        it was False, in 8 of 50 calls)."""
        self._value, self._error = value, error
        self._source.set_result(None)
        self._done.set()

    # ------------------------------------------------------------------ torch's Work API
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the collective ends; raise its error if it failed. A ``timeout`` of 0 (the
        default) waits for the collective, which itself ends by the process group's timeout."""
        seconds = timeout.total_seconds() if timeout else 0.0
        if not self._done.wait(seconds if seconds > 0 else None):
            raise dist.DistBackendError(f"dlcp: {self.what} did not finish within the {seconds:g} s "
                                        "given to Work.wait()")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        """The collective's output tensors, flattened in order, as gloo's works give them (an
        all_gather's every output, a barrier's none); raises the collective's error."""
        self.wait()
        return _tensors_in(self._value)

    def synchronize(self) -> None:
        """CPU tensors (and CUDA ones, copied back in the collective's thread): nothing to order."""

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("failed" if self._error is not None else "done")
        return f"DLCPWork({self.what}, {state})"


#: What torch calls on a work (``forwarding_backend.cc``'s ``HeldWork``, torch's Python): none of
#: it traced by ``torch.compile`` (:mod:`dlcp_torch.uncompiled`).
ENTRY_POINTS = ("wait", "get_future", "is_completed", "is_success", "exception", "result", "synchronize")
keep_out_of_compile(DLCPWork, ENTRY_POINTS)


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or lists and tuples of them, nested), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def _future_value(value: Any) -> Any:
    """What a work's future holds, by gloo's rule: the output tensors, and a collective of one
    input's list of outputs (an all_gather's) as that list itself, not inside another."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (list, tuple)):
        return list(value[0])
    return value
