"""Where an iteration's time goes, per worker: compute, waiting for the first byte of the
result, transmission, recovery, and the straggler wait.

From one worker's view of one iteration (monotonic times; pure functions):

* **compute**: from the iteration's start to its last gradient being ready;
* **first byte**: from then until the first data packet of a message that completes the
  synchronisation arrives (PS: the server's reply, which needs every worker's push; ring: the
  next step's chunk): the push, the wait for the other workers, aggregation;
* **recovery**: of the message that finished last, the time from its first recovery round
  (its first BITMAP) to its completion: bitmap rounds on the critical path;
* **transmission**: the rest of the synchronisation;
* **straggler**: how long after this worker the slowest worker of the same iteration finished
  (filled in by the report, which sees every worker).

compute + first byte + transmission + recovery is the iteration time.
"""

from __future__ import annotations

from collections.abc import Iterable

from dlcp.hostagent.messages import MessageStats

PARTS = ("compute", "first_byte", "transmission", "recovery", "straggler")


def iteration_breakdown(t0: float, ready: float, end: float, received: Iterable[MessageStats]) -> dict[str, float]:
    """Seconds of each part (but straggler) of an iteration that started at ``t0``, had its last
    gradient ready at ``ready`` and finished at ``end``; ``received``: the iteration's received
    messages (from :attr:`dlcp.hostagent.transport.Endpoint.message_log`)."""
    critical = [m for m in received if m.finished_at >= ready]
    sync = max(0.0, end - ready)
    arrivals = [m.first_arrival for m in critical if m.first_arrival is not None]
    first = max(ready, min(arrivals)) if arrivals else end
    first_byte = min(sync, first - ready)
    recovery = 0.0
    if critical:
        last = max(critical, key=lambda m: m.finished_at)
        if last.recovery_started is not None:
            recovery = max(0.0, min(sync - first_byte, last.finished_at - max(last.recovery_started, first)))
    return {"compute": max(0.0, ready - t0), "first_byte": first_byte,
            "transmission": max(0.0, sync - first_byte - recovery), "recovery": recovery}


def add_stragglers(records: list[dict]) -> None:
    """Set ``breakdown["straggler"]`` of every record: the slowest worker's end in that
    iteration minus this worker's end (records of several workers and iterations)."""
    last: dict[int, float] = {}
    for r in records:
        if "t_end" in r:
            last[r["iteration"]] = max(last.get(r["iteration"], r["t_end"]), r["t_end"])
    for r in records:
        if "breakdown" in r and "t_end" in r:
            r["breakdown"]["straggler"] = last[r["iteration"]] - r["t_end"]
