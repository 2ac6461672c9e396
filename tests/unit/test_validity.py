"""Validity of a testbed run: the verdict from samples, and the monitor sampling real processes."""

from __future__ import annotations

import subprocess
import sys
import time

from dlcp.topologies.runner import _reap
from dlcp.topologies.validity import (BacklogMeter, ProcessLife, RunMonitor, Sample, ValidityRules, judge, losses,
                                      machine_busy)

PORT = ("l1", 8)


def _samples(busy_pct: float, agent_pct: float, rate_pps: float, busy_share: float, n: int = 11) -> list[Sample]:
    """One sample a second: the machine ``busy_pct`` busy on 2 cores, an agent using ``agent_pct``
    of a core, and PORT backlogged ``busy_share`` of each second, serving ``rate_pps`` then."""
    out = []
    for i in range(n):
        total = 2.0 * i
        gaps = int(rate_pps * busy_share * i)
        # the rest of the machine's busy time goes to the switch: no CPU outside the run
        rest = max(0.0, 2.0 * busy_pct / 100 - agent_pct / 100) * i
        procs = {"worker0": agent_pct / 100 * i, "switch:l1": rest}
        out.append(Sample(float(i), (total * busy_pct / 100, total), procs,
                          {PORT: (gaps, int(busy_share * i * 1e6)) * 2}))  # backlogged throughout
    return out


def test_a_run_with_headroom_at_line_rate_is_valid():
    v = judge(_samples(60, 40, 1990, 0.5), 0.0, 10.0, {PORT: 2000.0}, ["worker0"])
    assert v.valid and v.reasons == []
    assert abs(v.machine_busy_p50 - 60) < 1e-6 and abs(v.processes["worker0"] - 40) < 1e-6
    row = v.bottlenecks[0]
    assert abs(row["rate_pps"] - 1990) < 1 and abs(row["busy_share"] - 0.5) < 1e-6


def test_a_saturated_machine_invalidates_and_says_so():
    v = judge(_samples(97, 40, 2000, 0.5), 0.0, 10.0, {PORT: 2000.0}, ["worker0"])
    assert not v.valid and len(v.reasons) == 1 and "machine saturated" in v.reasons[0] and "97 %" in v.reasons[0]


def test_a_cpu_bound_agent_invalidates():
    v = judge(_samples(60, 99, 2000, 0.5), 0.0, 10.0, {PORT: 2000.0}, ["worker0"])
    assert not v.valid and v.reasons == ["worker0 CPU-bound: median 99 % of a core"]


def test_a_backlogged_port_below_capacity_invalidates():
    v = judge(_samples(60, 40, 1500, 0.5), 0.0, 10.0, {PORT: 2000.0}, ["worker0"])
    assert not v.valid and "l1:8 served 1500 pps while backlogged, 75% of its 2000 pps" in v.reasons[0]


def test_packets_a_switch_lost_uncounted_invalidate_beyond_the_tolerance():
    ingress = losses({("s1", 1): 10_000, ("s1", 2): 5_000, ("s2", 1): 7},
                     {("s1", 1): 9_950, ("s1", 2): 4_999, ("s2", 1): 9})
    assert ingress == {("s1", 1): (10_000, 50), ("s1", 2): (5_000, 1), ("s2", 1): (7, 0)}
    buffer = losses({("s2", 3): 2_000}, {("s2", 3): 1_900})
    v = judge(_samples(60, 40, 1990, 0.5), 0.0, 10.0, {PORT: 2000.0}, ["worker0"],
              silent={"ingress": ingress, "buffer": buffer})
    # 50 of 10,000 and 100 of 2,000 are beyond 0.1 %; 1 of 5,000 is within it but still reported
    assert not v.valid and v.reasons == [
        "switch s2 port 3 lost 100 of 2000 admitted packets in BMv2's queue (full while its egress thread "
        "waited): the switch was starved of CPU",
        "switch s1 port 1 lost 50 of 10000 frames before its pipeline (BMv2's capture ring overflowed): "
        "the switch was starved of CPU"]
    assert [(r["where"], r["port"], r["lost"]) for r in v.silent_losses] == [
        ("buffer", 3, 100), ("ingress", 1, 50), ("ingress", 2, 1)]
    assert judge(_samples(60, 40, 1990, 0.5), 0.0, 10.0, {PORT: 2000.0}, ["worker0"],
                 ValidityRules(max_silent_loss=0.1), silent={"ingress": ingress, "buffer": buffer}).valid


def test_cpu_that_no_process_of_the_run_used_invalidates_beyond_the_limit():
    """The ring run of 20261129-155049 that took 3x its repetitions' sync time: 22 % of the
    machine went to no process of the run (quiet runs: 1-10 %, the kernel's forwarding)."""
    samples = [Sample(float(i), (2.0 * 0.7 * i, 2.0 * i), {"worker0": 0.4 * i, "switch:l1": 0.56 * i},
                      {PORT: (1990 * 0.5 * i, 0.5e6 * i) * 2}) for i in range(11)]  # 1.4 of 2 cores, 0.96 ours
    v = judge(samples, 0.0, 10.0, {PORT: 2000.0}, ["worker0"])
    assert not v.valid and v.reasons == [
        "other work on the machine: a median 22 % of all cores went to no process of the run (> 15 %)"]
    assert v.outside_busy_p50 is not None and abs(v.outside_busy_p50 - 22.0) < 1e-6
    assert v.as_dict()["outside_busy_p50"] == v.outside_busy_p50
    assert judge(samples, 0.0, 10.0, {PORT: 2000.0}, ["worker0"], ValidityRules(outside_busy_max=25)).valid
    quiet = judge(_samples(60, 40, 1990, 0.5), 0.0, 10.0, {PORT: 2000.0}, ["worker0"])
    assert quiet.valid and quiet.outside_busy_p50 is not None and abs(quiet.outside_busy_p50) < 1e-6


def test_a_port_hardly_ever_backlogged_gives_no_verdict():
    v = judge(_samples(60, 40, 100, 0.01), 0.0, 10.0, {PORT: 2000.0}, ["worker0"])
    assert v.valid and v.bottlenecks[0]["rate_pps"] is None and v.bottlenecks[0]["busy_slots"] < 200


def test_a_backlogged_port_above_capacity_invalidates_with_the_figure():
    """The runs behind the old headline: BMv2's per-priority rates served DLCP's ports 1.21-1.28x
    their capacity while backlogged. Above 1.03x a run is invalid; 1.02x passes."""
    v = judge(_samples(60, 40, 2560, 0.5), 0.0, 10.0, {PORT: 2000.0}, ["worker0"])
    assert not v.valid and v.reasons == [
        "bottleneck l1:8 served 1.28x its capacity while backlogged (2560 of 2000 pps): the port was faster "
        "than the run claims"]
    assert abs(v.bottlenecks[0]["ratio"] - 1.28) < 1e-3
    assert judge(_samples(60, 40, 2040, 0.5), 0.0, 10.0, {PORT: 2000.0}, ["worker0"]).valid


def test_frames_a_scheduler_dropped_invalidate():
    v = judge(_samples(60, 40, 1990, 0.5), 0.0, 10.0, {PORT: 2000.0}, ["worker0"],
              silent={"scheduler": {("sp1", 1): (5_000, 40)}})
    assert not v.valid and v.reasons == [
        "switch sp1 port 1 lost 40 of 5000 admitted frames in the port's scheduler (its FIFO overflowed)"]


def test_backlog_meter_counts_intervals_queued_at_both_ends():
    """Fake times: a port read every 50 ms; only intervals with frames queued at both ends count."""
    m = BacklogMeter()
    readings = [(0.00, 0, 0), (0.05, 3, 4), (0.10, 33, 10), (0.15, 63, 2), (0.20, 80, 0), (0.25, 80, 0),
                (0.30, 81, 5), (0.35, 111, 1)]
    for t, sent, queued in readings:
        m.observe(t, PORT, sent, queued)
    slots, micros = m.totals[PORT]
    # counted: 0.05-0.10 (30), 0.10-0.15 (30), 0.30-0.35 (30): 90 slots in 150 ms = 600 per second
    assert slots == 90 and abs(micros - 150_000) < 1e-6
    m.observe(0.35, PORT, 111, 1)  # a repeated time adds nothing
    assert m.totals[PORT] == (slots, micros)


def test_backlog_meter_times_a_bursty_port_only_where_it_was_backlogged_throughout():
    """Fake times, a port of 600 slots/s read every 10 ms, horizon 20 ms (12 slots). Bursts of
    4 slots that leave within 7 ms: the loose measure counts their emptied intervals as busy
    and reads low; the full one counts only intervals of at most 20 ms that began with 12 or
    more slots queued, where the port served at its capacity, whatever each interval's
    measured length (a short one passes the test no more easily than a long one)."""
    m = BacklogMeter({PORT: 600.0}, horizon=0.02)
    t, sent = 0.0, 0.0
    for _ in range(50):  # a burst: 4 frames queued at the read, all gone 6.7 ms later, one more arrives
        m.observe(t, PORT, sent, 4, 4.0)
        t, sent = t + 0.01, sent + 4.0
        m.observe(t, PORT, sent, 1, 1.0)
        t, sent = t + 0.01, sent + 1.0
    loose0, full0 = m.totals[PORT], m.full[PORT]
    assert full0 == (0.0, 0.0) and loose0[0] / (loose0[1] / 1e6) < 0.9 * 600  # loose: 4 slots in 10 ms
    m.observe(t, PORT, sent, 8, 8.0)  # 8 queued: enough for a 10 ms interval, not for the horizon
    t, sent = t + 0.01, sent + 6.0
    for dt in (0.01, 0.004, 0.016, 0.03, 0.01):  # backlogged throughout: 20 slots queued
        m.observe(t, PORT, sent, 20, 20.0)
        t, sent = t + dt, sent + 600.0 * dt
    m.observe(t, PORT, sent, 20, 20.0)
    fslots, fmicros = m.full[PORT]
    assert abs(fmicros - 40_000) < 1e-6  # the 30 ms interval and the one after 8 queued left out
    assert abs(fslots / (fmicros / 1e6) - 600.0) < 1e-6
    assert m.readings()[PORT] == (*m.totals[PORT], *m.full[PORT])


def test_the_full_measure_judges_slow_ports_and_the_loose_one_fast_ports():
    """The loose measure reads a bursty port at 85 %; the intervals backlogged throughout
    read 100 %: valid. Where those read 85 % too, the port was slow: invalid; where they are
    too few, no slow-port verdict. A port is too fast only by the loose measure, which can
    only read low."""
    def samples(loose: float, full_rate: float, full_us: float = 0.2e6) -> list[Sample]:
        return [Sample(float(i), (i * 2.0 * 0.5, i * 2.0), {"worker0": 0.4 * i, "switch:l1": 0.6 * i},
                       {PORT: (loose * 600 * 0.5 * i, 0.5e6 * i, full_rate * full_us / 1e6 * i, full_us * i)})
                for i in range(11)]
    v = judge(samples(0.85, 600.0), 0.0, 10.0, {PORT: 600.0}, ["worker0"])
    assert v.valid, v.reasons
    row = v.bottlenecks[0]
    assert abs(row["ratio"] - 0.85) < 1e-9 and abs(row["full_ratio"] - 1.0) < 1e-9
    assert abs(row["busy_share"] - 0.5) < 1e-9
    slow = judge(samples(0.85, 0.85 * 600), 0.0, 10.0, {PORT: 600.0}, ["worker0"])
    assert not slow.valid and "85%" in slow.reasons[0]
    few = judge(samples(0.85, 600.0, full_us=0.01e6), 0.0, 10.0, {PORT: 600.0}, ["worker0"])
    assert few.valid  # too few slots backlogged throughout: no slow-port verdict from the loose measure
    assert judge(samples(1.0, 1.07 * 600), 0.0, 10.0, {PORT: 600.0}, ["worker0"]).valid
    fast = judge(samples(1.05, 1.05 * 600), 0.0, 10.0, {PORT: 600.0}, ["worker0"])
    assert not fast.valid and "faster than the run claims" in fast.reasons[0]


def test_only_the_measured_window_counts():
    busy = [100.0] * 5 + [50.0] * 10  # start-up at 100 % CPU for 5 s, then 50 %
    samples, cpu = [], 0.0
    for t in range(len(busy) + 1):
        samples.append(Sample(float(t), (cpu, 2.0 * t), {"worker0": 0.4 * t, "switch:l1": cpu - 0.4 * t},
                              {PORT: (1000 * t, 500_000 * t)}))
        cpu += 2.0 * busy[t] / 100 if t < len(busy) else 0.0
    assert judge(samples, 0.0, 8.0, {PORT: 2000.0}, ["worker0"]).reasons  # mostly start-up: saturated
    assert judge(samples, 5.0, 15.0, {PORT: 2000.0}, ["worker0"]).valid  # the measured part is not


def test_a_window_too_short_to_judge_is_invalid_but_shows_the_whole_run():
    v = judge(_samples(10, 10, 2000, 0.5, n=6), 2.2, 2.6, {PORT: 2000.0}, ["worker0"])
    assert not v.valid and "too short to judge" in v.reasons[0]
    assert abs(v.machine_busy_p50 - 10) < 1e-6 and "worker0" in v.processes
    assert not judge(_samples(10, 10, 2000, 0.5, n=1), 0.0, 1.0, {PORT: 2000.0}, ["worker0"]).valid


def test_rules_are_configurable():
    v = judge(_samples(95, 40, 2000, 0.5), 0.0, 10.0, {PORT: 2000.0}, ["worker0"], ValidityRules(machine_busy_max=99))
    assert v.valid


def test_monitor_samples_a_real_busy_process_and_keeps_going_when_reads_fail():
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<3: pass"])
    calls = []

    def read_ports():
        calls.append(1)
        if len(calls) == 2:
            raise OSError("switch gone")
        return {PORT: (len(calls) * 100, len(calls) * 50_000)}

    mon = RunMonitor({"spin": spin.pid}, read_ports, interval=0.2).start()
    time.sleep(1.5)
    samples = mon.stop()
    spin.kill()
    assert len(samples) >= 5 and len(calls) == len(samples)
    assert samples[1].ports == {}  # the failed read is skipped, not fatal
    cpu = [100 * (b.procs["spin"] - a.procs["spin"]) / (b.t - a.t) for a, b in zip(samples, samples[1:])]
    assert max(cpu) > 20  # a spinning process shows as busy (an idle one is near 0; on an
    # oversubscribed machine a spinning one gets only its share of a core)
    assert all(0 <= b <= 100 for b in machine_busy(samples))


def test_a_process_no_two_samples_saw_is_judged_by_its_life_and_one_never_read_invalidates():
    samples = _samples(60, 40, 1990, 0.5)
    for s in samples[1:]:  # worker1 was read by the first sample only
        s.procs.pop("worker1", None)
    samples[0].procs["worker1"] = 0.0
    lives = {"worker1": ProcessLife(0.0, 0.0, 4.0, 3.9)}  # its reading at exit: 3.9 s of CPU in 4 s
    v = judge(samples, 0.0, 10.0, {PORT: 2000.0}, ["worker0", "worker1"], lives=lives)
    assert abs(v.processes["worker1"] - 97.5) < 1e-6 and abs(v.processes["worker0"] - 40) < 1e-6
    assert not v.valid and v.reasons == ["worker1 CPU-bound: median 98 % of a core"]
    # a sampled process keeps its median; its life is only the fallback
    v = judge(samples, 0.0, 10.0, {PORT: 2000.0}, ["worker0"], lives={"worker0": ProcessLife(0.0, 0.0, 1.0, 1.0)})
    assert v.valid and abs(v.processes["worker0"] - 40) < 1e-6
    v = judge(samples, 0.0, 10.0, {PORT: 2000.0}, ["worker0", "worker2"])
    assert not v.valid and v.reasons == ["worker2's CPU use was never read: nothing says it did not set the pace"]


def test_a_process_that_exits_between_samples_is_read_at_exit_before_it_is_reaped():
    # it spins 0.3 s of its own CPU once told to go, then exits; the monitor samples only at
    # its start and stop (an hour apart), as a starved one on a saturated machine might
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nsys.stdin.readline()\n"
                              "t = time.process_time()\nwhile time.process_time() - t < 0.3: pass"],
                             stdin=subprocess.PIPE)
    mon = RunMonitor({}, dict, interval=3600).start()
    mon.add("worker0", child.pid)  # read when added (and perhaps by the first sample), before it spins
    assert child.stdin is not None
    child.stdin.write(b"go\n")
    child.stdin.close()
    while _reap(mon, {"worker0": child}):
        time.sleep(0.05)
    assert child.returncode == 0
    samples = mon.stop()
    assert len(samples) == 2 and "worker0" not in samples[-1].procs  # gone before the last sample
    life = mon.lives["worker0"]
    assert life.cpu1 - life.cpu0 >= 0.29 and life.t1 > life.t0
    assert _reap(mon, {"worker0": child}) is False  # an exited process stays exited
