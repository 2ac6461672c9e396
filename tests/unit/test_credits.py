"""The credit rules (dlcp.hostagent.datapath.credits): when a receiver credits a sender, and what a
sender may count as done with after a credit. Pure functions, no sockets."""

from __future__ import annotations


import pytest

from dlcp.hostagent.datapath.credits import CREDIT_QUIET, acked_after_credit, credit_due, release_due

KEY = bytes(range(16))


@pytest.mark.parametrize("pending, quiet_for, due", [
    (0, 1.0, False),                 # nothing consumed, no overrun: nothing to grant
    (3, 0.0, False),                 # a few packets of a stream still coming
    (25, 0.0, True),                 # a quarter of the window (100) used
    (3, CREDIT_QUIET, True),         # the stream went quiet: it may be held by its window
])
def test_a_credit_is_due_by_the_quarter_or_the_quiet(pending, quiet_for, due):
    assert credit_due(pending, 100, quiet_for) is due


def test_after_an_overrun_a_quiet_sender_is_credited_even_with_nothing_consumed():
    # Its whole window may have been dropped by the kernel: nothing consumed, yet it is held.
    assert credit_due(0, 100, CREDIT_QUIET, overrun=True)
    assert not credit_due(0, 100, CREDIT_QUIET / 2, overrun=True)  # its packets may still be coming


def test_a_release_credit_releases_all_sent_and_no_credit_takes_anything_back():
    assert acked_after_credit(acked=10, sent=90, consumed=40, release=False) == 40
    assert acked_after_credit(acked=10, sent=90, consumed=40, release=True) == 90
    assert acked_after_credit(acked=50, sent=90, consumed=40, release=False) == 50  # a late credit


def test_a_quiet_sender_with_an_incomplete_message_is_released_once_the_reader_caught_up():
    t = 10.0  # its latest packet arrived then
    assert release_due(True, False, t, t + CREDIT_QUIET)
    assert not release_due(True, False, t, t + CREDIT_QUIET / 2)  # the rest may be on its way
    assert not release_due(False, False, t, t + 1.0)  # nothing of it is missing
    assert not release_due(True, True, t, t + 1.0)  # released already since its latest packet
    assert not release_due(True, False, -1.0, t)  # nothing of it ever arrived
