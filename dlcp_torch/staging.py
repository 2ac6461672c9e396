"""Device tensors through host memory: what the ``dlcp`` backend does with a CUDA tensor.

DLCP's transport reads and writes host memory (its data path places packets by offset into a
buffer it holds a pointer to), so a collective on a GPU tensor runs on a host copy: the
tensor is copied into a pinned host buffer, the collective runs there, and the result is
copied back. Pinned (page-locked) buffers make the copies asynchronous DMA; they are costly to
allocate, so they are kept per (dtype, size) and reused, as DDP calls with the same buckets
every step.

Ordering: the copy to the host waits, on a side stream, for an event recorded when the
collective was issued (so it reads the gradient the backward pass wrote, without blocking the
device); the copy back is finished before the collective's work completes, so ``wait()``
returns with the result on the device. Copies overlap the exchange across calls: the backend
runs each collective in its own pool thread, so while one DDP bucket is exchanged, the next
one is being copied.

Not run on a GPU: this machine has none. The logic (which tensors are staged, buffer reuse,
the order copy in / collective / copy back, the result landing in the caller's tensor) is
tested on CPU through :class:`HostCopies`, the same code path with plain host copies.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch


class HostCopies:
    """Copies between a tensor and host memory, and the ordering they need.

    This one is for tensors already in host memory, forced through staging (``always=True``):
    plain synchronous copies. :class:`CudaCopies` is the GPU's.
    """

    pinned = False

    def __init__(self, always: bool = False) -> None:
        self.always = always

    def needs_staging(self, t: torch.Tensor) -> bool:
        return self.always or t.device.type != "cpu"

    def issued(self, tensors: list[torch.Tensor]) -> Any:
        """Called in the caller's thread when a collective is issued: a mark the copy in waits for."""
        return None

    def to_host(self, host: torch.Tensor, t: torch.Tensor, mark: Any) -> None:
        host.copy_(t.detach().reshape(-1))

    def to_device(self, t: torch.Tensor, host: torch.Tensor) -> None:
        with torch.no_grad():
            t.copy_(host.view(t.shape))

    def finish(self) -> None:
        """Block until every copy this thread issued is done."""


class CudaCopies(HostCopies):
    """Copies between a CUDA tensor and pinned host memory, on a side stream per thread."""

    pinned = True

    def __init__(self) -> None:
        super().__init__(always=False)
        self._local = threading.local()

    def _stream(self, device: torch.device) -> Any:
        streams = self._local.__dict__.setdefault("streams", {})
        if device not in streams:
            streams[device] = torch.cuda.Stream(device=device)
        return streams[device]

    def issued(self, tensors: list[torch.Tensor]) -> Any:
        marks = {}
        for t in tensors:
            if t.device.type == "cuda" and t.device not in marks:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(t.device))
                marks[t.device] = ev
        return marks

    def to_host(self, host: torch.Tensor, t: torch.Tensor, mark: Any) -> None:
        s = self._stream(t.device)
        s.wait_event(mark[t.device])
        with torch.cuda.stream(s):
            host.copy_(t.detach().reshape(-1), non_blocking=True)
        s.synchronize()  # the exchange reads the host buffer next

    def to_device(self, t: torch.Tensor, host: torch.Tensor) -> None:
        s = self._stream(t.device)
        with torch.cuda.stream(s), torch.no_grad():
            t.copy_(host.view(t.shape), non_blocking=True)

    def finish(self) -> None:
        for s in self._local.__dict__.get("streams", {}).values():
            s.synchronize()


class Staging:
    """Host buffers for device tensors, reused per (dtype, size)."""

    def __init__(self, copies: HostCopies | None = None) -> None:
        self.copies = copies or (CudaCopies() if torch.cuda.is_available() else HostCopies())
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocated = 0
        """Host buffers made so far (a steady training loop stops making them after its first step)."""

    def _take(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        with self._lock:
            free = self._free[(dtype, n)]
            if free:
                return free.pop()
            self.allocated += 1
        return torch.empty(n, dtype=dtype, pin_memory=self.copies.pinned)

    def _give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free[(buf.dtype, buf.numel())].append(buf)

    def issued(self, groups: list[list[torch.Tensor]]) -> Any:
        """Call where the collective is issued (the caller's thread): see :meth:`HostCopies.issued`."""
        return self.copies.issued([t for g in groups for t in g if self.copies.needs_staging(t)])

    def run(self, groups: list[list[torch.Tensor]], mark: Any, collective: Callable[[], Any]) -> None:
        """Run ``collective`` with every device tensor of ``groups`` replaced, in place in its
        list, by a host copy; then copy each back (results, and unchanged inputs alike) and put
        the caller's tensors back in the lists."""
        staged: list[tuple[list[torch.Tensor], int, torch.Tensor, torch.Tensor]] = []
        try:
            for g in groups:
                for i, t in enumerate(g):
                    if not self.copies.needs_staging(t):
                        continue
                    host = self._take(t.dtype, t.numel())
                    self.copies.to_host(host, t, mark)
                    staged.append((g, i, t, host))
                    g[i] = host.view(t.shape)
            collective()
            for _g, _i, t, host in staged:
                self.copies.to_device(t, host)
        finally:
            self.copies.finish()  # no copy may still read or write a buffer given back
            for g, i, t, host in staged:
                g[i] = t
                self._give(host)


__all__ = ["CudaCopies", "HostCopies", "Staging"]
