"""messages.wait_all: the results of many handles with one wake-up of the waiting thread, and
the same results and errors as waiting on each in turn."""

from __future__ import annotations

import threading
import time

import pytest

from dlcp.hostagent.messages import RecvHandle, SendHandle, TransportError, TransportTimeout, wait_all


def _handles(n: int) -> list[SendHandle]:
    return [SendHandle(peer=1, message_id=m) for m in range(n)]


def test_the_results_come_in_the_handles_order_whatever_order_they_settle_in():
    hs = _handles(4)
    for i in (2, 0, 3, 1):
        hs[i]._resolve(f"r{i}")
    assert wait_all(hs, time.monotonic() + 1) == ["r0", "r1", "r2", "r3"]


def test_the_waiter_returns_only_once_the_last_handle_settles():
    hs = _handles(3)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(wait_all(hs, time.monotonic() + 30)))
    waiter.start()
    hs[0]._resolve("a")
    hs[2]._resolve("c")
    waiter.join(0.2)  # (settling all but one: still waiting)
    assert waiter.is_alive() and not got
    hs[1]._resolve("b")
    waiter.join(30)
    assert got == [["a", "b", "c"]]


class _CountingEvent(threading.Event):
    """An event that counts the waits that found it not set (a thread put to sleep on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps = 0

    def wait(self, timeout: float | None = None) -> bool:
        if not self.is_set():
            self.sleeps += 1
        return super().wait(timeout)


def test_nobody_sleeps_on_a_handles_own_event_only_on_the_waits_one():
    """The waiter registers one callback on each open handle and sleeps on one event of its
    own, which the last handle to settle sets: settling the others wakes nobody."""
    hs = _handles(3)
    events = [_CountingEvent() for _ in hs]
    for h, e in zip(hs, events):
        h._event = e
    waiter = threading.Thread(target=wait_all, args=(hs, time.monotonic() + 30))
    waiter.start()
    until = time.monotonic() + 10
    while not all(h._callbacks for h in hs) and time.monotonic() < until:  # (the waiter registers on each)
        time.sleep(0.001)
    assert all(len(h._callbacks) == 1 for h in hs)
    for i, h in enumerate(hs):
        h._resolve(i)
    waiter.join(30)
    assert not waiter.is_alive()
    assert [e.sleeps for e in events] == [0, 0, 0]


def test_the_first_error_in_order_is_raised_as_a_wait_on_each_would():
    hs = _handles(3)
    hs[2]._fail(TransportError("third"))
    hs[0]._resolve("a")
    hs[1]._fail(TransportError("second"))
    with pytest.raises(TransportError, match="second"):
        wait_all(hs, time.monotonic() + 1)


def test_a_handle_still_open_at_the_deadline_times_out_naming_it():
    hs = [RecvHandle(peer=2, message_id=7, out=None), RecvHandle(peer=3, message_id=8, out=None)]
    hs[0]._resolve("a")
    with pytest.raises(TransportTimeout, match="message 8 with rank 3"):
        wait_all(hs, time.monotonic() + 0.05)


def test_no_handles_and_settled_handles_return_at_once():
    assert wait_all([], time.monotonic()) == []
    hs = _handles(2)
    for h in hs:
        h._resolve("x")
    assert wait_all(hs, time.monotonic() - 1) == ["x", "x"]  # (a past deadline: nothing is waited for)


def test_a_failure_wakes_the_waiter_at_once_though_other_handles_stay_open():
    """A lost peer fails its messages at once while the messages with other peers stay open:
    the waiter raises the failure then, not at the deadline (a survivor of a killed rank waited
    out the whole deadline before this)."""
    hs = _handles(3)
    got: list = []

    def wait() -> None:
        try:
            wait_all(hs, time.monotonic() + 30)
        except TransportError as exc:
            got.append((str(exc), time.monotonic()))
    waiter = threading.Thread(target=wait)
    waiter.start()
    until = time.monotonic() + 10
    while not all(h._callbacks for h in hs) and time.monotonic() < until:
        time.sleep(0.001)
    failed_at = time.monotonic()
    hs[0]._fail(TransportError("peer rank 2 lost"))  # hs[1] and hs[2] never settle
    waiter.join(10)
    assert got and got[0][0] == "peer rank 2 lost" and got[0][1] - failed_at < 5
