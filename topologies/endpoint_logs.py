"""Reading an endpoint's logs for a testbed agent's records: the tails appended since an
iteration began, and the message and rate traces a record carries. Shared by DLCP's agents
(:mod:`dlcp.topologies.agent`) and the dlcp backend's (:mod:`dlcp.topologies.ddp_agent`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from dlcp.hostagent.exchange import iteration_of, step_of, tensor_of
from dlcp.hostagent.messages import MessageStats, RateChange

LOG_SLACK = 1.0
"""Seconds by which a log's append times may run out of order (they are the protocol core's
``now`` at each append, which only moves forward; the slack is a margin, not a measured skew)."""


def recent(log: Iterable, since: float, time_of: Callable[[Any], float]) -> list:
    """The tail of an append-ordered log (``message_log``: ``finished_at``; ``rate_log``:
    ``time``) whose entries were appended at ``since`` - :data:`LOG_SLACK` or later, oldest first.

    Why: the per-iteration records read the endpoint's logs every iteration. Filtering the whole
    of them (4,096 messages, 16,384 rate changes) cost each DLCP worker 0.85 ms of Python per
    iteration against 0.31 ms for the tails (full logs of 24 messages per iteration, timed on
    this machine), CPU that gloo's workers do not spend, on a machine whose validity rules count
    it. The copy (``list``) is one C-level pass and safe against the core's thread appending."""
    snapshot = list(log)
    i = len(snapshot)
    while i > 0 and time_of(snapshot[i - 1]) >= since - LOG_SLACK:
        i -= 1
    return snapshot[i:]


def finished_at(m: MessageStats) -> float:
    return m.finished_at


def changed_at(c: RateChange) -> float:
    return c.time


def message_trace(log: Iterable[MessageStats], iteration: int | None, t0: float) -> list[list]:
    """The messages of ``iteration`` (None: every one, as the backend numbers its collectives,
    not the training's iterations) that started at ``t0`` or later in an endpoint's
    ``message_log`` (sent and received), for seeing where a sync's time went bucket by bucket
    and step by step, and for comparing with ``dlcp sim``: rows of [direction, peer, tensor
    (bucket), step, packets, retransmitted, start ms, first packet ms (receiver), finish ms],
    times from the iteration's start ``t0``, in order of start."""
    def ms(t: float | None) -> float | None:
        return None if t is None else round(1e3 * (t - t0), 3)

    rows = [[m.direction, m.peer, tensor_of(m.message_id), step_of(m.message_id), m.packets, m.retransmissions,
             ms(m.started), ms(m.first_arrival), ms(m.finished_at)]
            for m in log if (iteration is None or iteration_of(m.message_id) == iteration % 1024) and m.started >= t0]
    return sorted(rows, key=lambda r: r[6])


def rate_trace(log: Iterable[RateChange], mtu: int, since: float, until: float | None = None) -> list[list]:
    """The changes of an endpoint's pacing rates (``Endpoint.rate_log``) from ``since`` (to
    ``until``): rows of [ms from ``since``, destination, packets of ``mtu`` bytes per second,
    cause], to see whether a slow transfer was cut by marks, losses or its receiver's ceiling."""
    return [[round(1e3 * (c.time - since), 3), c.dest, round(c.rate / mtu, 1), c.cause]
            for c in log if c.time >= since and (until is None or c.time <= until)]
