"""Rate control and pacing: pure state machines, checked step by step."""

import numpy as np
import pytest

from dlcp.hostagent.policy import retransmission_set
from dlcp.hostagent.ratecontrol import RateConfig, RateController, link_rates


def test_additive_increase_capped_at_line_rate():
    rc = RateController(RateConfig(initial_rate=100.0, line_rate=110.0, min_rate=1.0, additive_increase=4.0))
    assert rc.on_feedback(10, 0, 0) == 104.0
    assert rc.on_feedback(10, 0, 0) == 108.0
    assert rc.on_feedback(10, 0, 0) == 110.0  # never above the line rate


def test_decrease_grows_with_the_marked_fraction():
    cfg = RateConfig(initial_rate=1000.0, line_rate=1000.0, min_rate=1.0, gain=0.5)
    few, all_ = RateController(cfg), RateController(cfg)
    few.on_feedback(100, 10, 0)
    all_.on_feedback(100, 100, 0)
    assert all_.rate < few.rate < 1000.0
    # alpha starts at 1 (as Linux DCTCP); all marked keeps it at 1 -> cut by alpha / 2 = 50 %
    assert all_.rate == pytest.approx(500.0)
    # alpha = 0.5 * 1 + 0.5 * 0.1 = 0.55 -> cut by 27.5 %
    assert few.rate == pytest.approx(725.0)


def test_loss_counts_as_congestion_and_floor_holds():
    rc = RateController(RateConfig(initial_rate=10.0, line_rate=10.0, min_rate=5.0, gain=1.0))
    for _ in range(10):
        rc.on_feedback(0, 0, 100)
    assert rc.rate == 5.0 and rc.decreases == 10
    assert rc.on_feedback(0, 0, 0) == 5.0  # an empty report changes nothing


def test_a_cut_waits_for_its_window_to_be_reported():
    """Reports every 2 ms that still carry marks from packets queued before a cut do not cut
    again (as on the testbed: a dozen halvings in 40 ms took a sender to its floor)."""
    cfg = RateConfig(initial_rate=1000.0, line_rate=1000.0, min_rate=1.0, gain=1 / 16)
    rc = RateController(cfg)
    rc.on_sent(40)  # 40 packets in flight when the marks come back
    rc.on_feedback(4, 4, 0, now=0.0, hold=1.0)
    assert rc.decreases == 1 and rc.rate == pytest.approx(500.0)
    for k in range(1, 9):  # 32 more of the 40, all marked: the old window, no new cut
        rc.on_sent(1)
        rc.on_feedback(4, 4, 0, now=0.002 * k, hold=1.0)
    assert rc.decreases == 1 and rc.rate == pytest.approx(500.0)
    rc.on_feedback(4, 4, 0, now=0.02, hold=1.0)  # 40 reported: the window is over, marks cut again
    assert rc.decreases == 2 and rc.rate < 500.0


def test_a_cut_held_no_longer_than_hold():
    """Packets lost without a report never complete a window: ``hold`` bounds the wait."""
    rc = RateController(RateConfig(initial_rate=1000.0, line_rate=1000.0, min_rate=1.0))
    rc.on_sent(100)
    rc.on_feedback(1, 1, 0, now=0.0, hold=0.05)
    rc.on_feedback(1, 1, 0, now=0.04, hold=0.05)
    assert rc.decreases == 1
    rc.on_feedback(1, 1, 0, now=0.06, hold=0.05)
    assert rc.decreases == 2


def test_untimed_losses_always_cut():
    """A BITMAP's losses cut at once, window or not."""
    rc = RateController(RateConfig(initial_rate=1000.0, line_rate=1000.0, min_rate=1.0))
    rc.on_sent(100)
    rc.on_feedback(1, 1, 0, now=0.0, hold=1.0)
    rc.on_feedback(90, 0, 10)
    rc.on_feedback(90, 0, 10, now=0.001, timed=False)
    assert rc.decreases == 3


def test_a_bitmaps_cut_starts_a_window_the_marks_after_it_wait_out():
    """After a BITMAP's cut, reports still marked for packets sent before it do not cut again
    until those are reported or the hold passed. (A BITMAP's cut used to clear the window, so
    the next marked report cut at once: on the testbed, loss and mark cuts alternated every
    10-30 ms and took a sender from 400 to 65 kB/s.)"""
    rc = RateController(RateConfig(initial_rate=1000.0, line_rate=1000.0, min_rate=1.0))
    rc.on_sent(100)
    rc.on_feedback(90, 0, 10, now=0.0, hold=1.0, timed=False)
    assert rc.decreases == 1
    for k in range(1, 5):  # marks from the same 100 packets
        rc.on_feedback(10, 10, 0, now=0.01 * k, hold=1.0)
    assert rc.decreases == 1
    rc.on_feedback(70, 10, 0, now=0.05, hold=1.0)  # all 100 reported: the window is over
    assert rc.decreases == 2


def test_config_validation():
    with pytest.raises(ValueError):
        RateConfig(initial_rate=10.0, line_rate=5.0)
    with pytest.raises(ValueError):
        RateConfig(gain=0.0)


def test_pacing_slack_must_not_be_negative():
    """(The pacer itself runs in the compiled data path: tests/transport/test_core_rules.py.)"""
    with pytest.raises(ValueError, match="pacing_slack"):
        RateConfig(pacing_slack=-1e-6)


def test_retransmission_set_recovers_only_beyond_the_bound():
    classes = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    counts = np.full(8, 10)
    missing = np.array([1, 3, 5, 7])
    # p = 0: everything missing, most important class first, then by seq
    assert retransmission_set(missing, classes, counts, 40, 80, 0.0).tolist() == [1, 5, 3, 7]
    # p = 0.25 of 80 elements: 60 needed, 40 held -> two packets, the class-1 ones
    assert retransmission_set(missing, classes, counts, 40, 80, 0.25).tolist() == [1, 5]
    # already within the bound: nothing
    assert retransmission_set(missing, classes, counts, 40, 80, 0.5).tolist() == []


def test_clean_reports_grant_increase_for_the_time_they_cover():
    cfg = RateConfig(initial_rate=1e6, line_rate=1e9, additive_increase=1e5, increase_interval=0.002,
                     max_increase_span=0.05)
    rc = RateController(cfg)
    rc.on_feedback(10, 0, 0, now=1.0)  # first report: one interval's worth
    assert rc.rate == pytest.approx(1e6 + 1e5)
    rc.on_feedback(10, 0, 0, now=1.010)  # 10 ms later: five intervals' worth
    assert rc.rate == pytest.approx(1.1e6 + 5e5)
    rc.on_feedback(10, 0, 0, now=5.0)  # after an idle gap: at most max_increase_span
    assert rc.rate == pytest.approx(1.6e6 + 25 * 1e5)


def test_receiver_ceiling_caps_the_start_and_lifts_when_withdrawn():
    rc = RateController(RateConfig(initial_rate=5e8, line_rate=1e9))
    rc.on_ceiling(1e8)
    assert rc.rate == 1e8 and rc.effective_rate == 1e8  # a new sender starts no faster than the receiver drains
    rc.on_feedback(10, 0, 0, now=0.0)
    assert rc.rate > 1e8 and rc.effective_rate == 1e8  # probes upward, still capped
    for t in range(1, 200):  # a long time capped: the rate underneath does not run away
        rc.on_feedback(10, 0, 0, now=t * 0.01)
    assert rc.rate == pytest.approx(1.25e8) and rc.effective_rate == 1e8
    rc.on_ceiling(2e8)
    assert 1e8 < rc.effective_rate <= 2e8
    rc.on_ceiling(0)  # the receiver keeps up: no ceiling, and the rate resumes near the last one
    assert rc.effective_rate == rc.rate <= 1.25 * 2e8


def test_answer_timer_waits_for_the_usual_answer_plus_its_jitter():
    from dlcp.hostagent.ratecontrol import AnswerTimer

    t = AnswerTimer(initial=0.005, floor=0.001, ceiling=0.5)
    assert t.probe_delay() == 0.005  # nothing measured yet
    for _ in range(50):
        t.sample(0.002)
    assert t.probe_delay() == pytest.approx(0.002, abs=2e-4)  # steady answers: little jitter
    t.sample(0.02)  # one slow answer widens the wait
    assert t.probe_delay() > 0.01
    assert t.reprobe_timeout() >= 0.05
    with pytest.raises(ValueError):
        AnswerTimer(initial=0.005, floor=0.0, ceiling=0.5)


def test_drain_share_splits_the_measured_drain_or_the_start_up_estimate():
    """(The drain meter itself runs in the compiled data path: tests/transport/test_core_rules.py.)"""
    from dlcp.hostagent.ratecontrol import drain_share

    assert drain_share(50e6, 0, active_senders=4, new_sender=False) == pytest.approx(12.5e6)
    assert drain_share(0, 80e6, active_senders=1, new_sender=True) == pytest.approx(40e6)
    assert drain_share(0, 80e6, active_senders=1, new_sender=False) == 0


def test_a_config_for_a_link_scales_its_start_and_increase_with_it():
    cfg = RateConfig.for_link(25e9 / 8)
    assert cfg.line_rate == 25e9 / 8
    assert cfg.initial_rate == cfg.line_rate / 2
    assert cfg.additive_increase == cfg.line_rate / 100
    assert cfg.burst_bytes == RateConfig.burst_bytes  # 0.2 ms of the link, at most the default 256 KB ...
    assert RateConfig.for_link(1e9 / 8).burst_bytes == 25_000
    assert RateConfig.for_link(925_000.0, 1500).burst_bytes == 16 * 1500  # ... and at least 16 datagrams
    assert RateConfig.for_link(1e9, min_rate=5e6).min_rate == 5e6
    with pytest.raises(ValueError, match="min_rate <= initial_rate"):
        RateConfig.for_link(1e6, min_rate=2e6)


def test_the_testbeds_hosts_are_told_what_a_user_sets_for_their_link():
    """Issue 43: the hosts once started at half the bottleneck and were allowed twice it; now
    their rates are ``for_link``'s for a link of the fabric's rate (pacing and burst aside)."""
    knobs = link_rates(925_000.0, 1500)
    user = RateConfig.for_link(925_000.0)
    ours = RateConfig(**knobs)
    assert (ours.line_rate, ours.initial_rate, ours.additive_increase, ours.min_rate) == (
        user.line_rate, user.initial_rate, user.additive_increase, user.min_rate) == (925e3, 462.5e3, 9250, 9250)
    assert set(knobs) == {"initial_rate", "line_rate", "min_rate", "additive_increase", "burst_bytes", "pacing_slack"}
