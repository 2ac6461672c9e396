"""The line-rate bound: traffic matrices, ECMP path fractions, port loads, and the bound itself."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dlcp.hostagent.errors import UsageError
from dlcp.hostagent.packetizer import elems_per_packet
from dlcp.topologies.bound import (bucket_sizes, cross_traffic_load, iteration_traffic, line_rate_bound,
                                   message_packets, path_fractions, port_loads)
from dlcp.topologies.runner import RunOptions, agent_spec, scheme_policy
from dlcp.topologies.topos import leafspine, star, with_host_ports

PER = elems_per_packet(1500, np.float32)  # 357


def _spec(scheme: str = "baseline", **kw) -> dict:
    opts = RunOptions(**kw)
    return agent_spec(opts, scheme_policy(scheme, opts), ["10.0.0.1"] * (opts.workers + 1))


def _names(topo):
    return [h.name for h in topo.role("worker")], topo.role("server")[0], [h.name for h in topo.role("cross")]


def test_message_packets_by_hand():
    assert message_packets(1000, PER) == 3
    assert message_packets(0, PER, 0.05) == 0
    assert message_packets(20 * PER, PER, 0.05) == 19  # 5% of 20 full packets: exactly one may go
    assert message_packets(10 * PER, PER, 0.05) == 10  # 9.5 packets needed: still 10


def test_star_ps_server_port_carries_every_push():
    topo = star(4)
    workers, server, _ = _names(topo)
    traffic = iteration_traffic(_spec(workers=4), topo)
    push = traffic[(workers[0], server.name)]
    assert push == sum(math.ceil(n / PER) for n in bucket_sizes(_spec(workers=4)))
    assert all(traffic[(w, server.name)] == push and traffic[(server.name, w)] == push for w in workers)
    assert len(traffic) == 8  # nothing between workers in PS
    loads = port_loads(topo, traffic)
    sw = topo.switches[0].name
    assert loads[(sw, server.port)] == pytest.approx(4 * push)
    assert loads[(sw, topo.role("worker")[0].port)] == pytest.approx(push)  # its pull


def test_leafspine_ecmp_splits_over_both_spines():
    topo = leafspine(4)
    workers, server, _ = _names(topo)
    l1, l2, sp1, sp2 = (s.name for s in topo.switches)
    assert path_fractions(topo, workers[0], server.name) == {
        (l1, 8): 0.5, (l1, 9): 0.5, (sp1, 2): 0.5, (sp2, 2): 0.5, (l2, server.port): 1.0}
    right = path_fractions(topo, workers[2], server.name)  # same leaf as the server
    assert right == {(l2, server.port): 1.0} and not set(right) & topo.bottlenecks

    traffic = iteration_traffic(_spec(topology="leafspine", workers=4), topo)
    push = traffic[(workers[0], server.name)]
    loads = port_loads(topo, traffic)
    for port in [(l1, 8), (l1, 9), (sp1, 2), (sp2, 2)]:  # two left workers' pushes, half each way
        assert loads[port] == pytest.approx(push)
    for port in [(l2, 8), (l2, 9), (sp1, 1), (sp2, 1)]:  # the pulls back to them
        assert loads[port] == pytest.approx(push)
    assert loads[(l2, server.port)] == pytest.approx(4 * push)


@pytest.mark.parametrize("workers", [2, 3, 4, 7])
def test_ring_sends_2_w_minus_1_over_w_of_the_message(workers):
    topo = star(workers)
    spec = _spec(workers=workers, pattern="ring")
    names, _, _ = _names(topo)
    traffic = iteration_traffic(spec, topo)
    assert set(traffic) == {(names[r], names[(r + 1) % workers]) for r in range(workers)}
    buckets = bucket_sizes(spec)
    ideal = 2 * (workers - 1) / workers * sum(buckets) / PER
    slack = 2 * (workers - 1) * len(buckets)  # at most one partial packet per chunk sent
    for packets in traffic.values():
        assert ideal - 1 <= packets <= ideal + slack  # chunks differ by an element: -1 covers it


def test_ring_two_workers_by_hand():
    topo = star(2)
    spec = _spec(workers=2, pattern="ring")
    names, _, _ = _names(topo)
    # each bucket: two chunks (floor(n/2) and the rest); each rank sends one in each phase
    expect = sum(math.ceil((n // 2) / PER) + math.ceil((n - n // 2) / PER) for n in bucket_sizes(spec))
    traffic = iteration_traffic(spec, topo)
    assert traffic == {(names[0], names[1]): expect, (names[1], names[0]): expect}


@pytest.mark.parametrize("pattern", ["ps", "ring"])
def test_bounded_loss_lowers_the_pushes_by_about_p(pattern):
    topo = star(4)
    spec = _spec("dlcp", workers=4, pattern=pattern, loss_bound=0.1)
    full = iteration_traffic(spec, topo, bounded=False)
    assert full == iteration_traffic(_spec("baseline", workers=4, pattern=pattern), topo)
    bounded = iteration_traffic(spec, topo)
    n_msgs = len(bucket_sizes(spec)) * (4 if pattern == "ps" else 2 * 3)
    if pattern == "ps":
        server = topo.role("server")[0].name
        for w in _names(topo)[0]:
            lo, hi = bounded[(w, server)], full[(w, server)]
            k = len(bucket_sizes(spec))  # rounding: at most one packet per message either way
            assert 0.9 * hi - k <= lo <= 0.9 * hi + k
            assert bounded[(server, w)] == full[(server, w)]  # the pull bound is 0: replies stay whole
    else:  # reduce-scatter (half the steps) at p, all-gather at 0: about p/2 fewer in all
        for flow, hi in full.items():
            assert 0.95 * hi - 1 <= bounded[flow] <= 0.95 * hi + n_msgs
            assert bounded[flow] < hi


def test_bound_by_hand_star():
    topo = star(2)
    (w1, w2), server, _ = _names(topo)
    sw = topo.switches[0].name
    traffic = {(w1, server.name): 100, (w2, server.name): 50, (server.name, w1): 30}
    b = line_rate_bound(topo, traffic, 200, {(sw, server.port): 50})
    assert (b.seconds, b.port, b.packets, b.capacity_left_pps) == (1.0, (sw, server.port), 150, 150)
    assert b.loads[(sw, 1)] == 30 and b.loads[(sw, 2)] == 0 and len(b.loads) == len(topo.bottlenecks)
    assert line_rate_bound(topo, traffic, 200).seconds == pytest.approx(150 / 200)


def test_bound_by_hand_leafspine_ecmp():
    topo = leafspine(4)
    workers, server, _ = _names(topo)
    b = line_rate_bound(topo, {(workers[0], server.name): 100}, 100)
    assert b.seconds == pytest.approx(0.5) and b.packets == pytest.approx(50)  # half on each uplink
    assert line_rate_bound(topo, {(workers[2], server.name): 100}, 100).port is None  # no bottleneck crossed


def test_no_capacity_left_gives_an_infinite_bound():
    topo = star(2)
    (w1, _), server, _ = _names(topo)
    sw = topo.switches[0].name
    b = line_rate_bound(topo, {(w1, server.name): 10}, 100, {(sw, server.port): 120})
    assert b.seconds == math.inf and b.port == (sw, server.port) and b.capacity_left_pps == -20
    # a saturated port the gradients do not cross does not bind
    assert line_rate_bound(topo, {(w1, server.name): 10}, 100, {(sw, 2): 100}).seconds == pytest.approx(0.1)


def test_cross_traffic_is_the_expectation_over_hash_outcomes():
    topo = leafspine(4)
    _, _, (x1, x2) = _names(topo)
    l1, l2, sp1, sp2 = (s.name for s in topo.switches)
    x2_port = topo.role("cross")[1].port
    load = cross_traffic_load(topo, x1, x2, 100, 0.5)
    assert load == {(l1, 8): 25, (l1, 9): 25, (sp1, 2): 25, (sp2, 2): 25, (l2, x2_port): 50}
    traffic = {(topo.role("worker")[0].name, topo.role("server")[0].name): 100}
    b = line_rate_bound(topo, traffic, 100, load)
    assert b.seconds == pytest.approx(50 / 75)


def test_a_paced_hosts_own_link_binds_a_servers_answers_on_free_host_ports():
    """A parameter server answering four workers sends all of it through its own link: with
    hosts paced to the fabric's rate it binds, where the topology limits no host port (the
    ablation's PS on leafspine: every DLCP variant then stops at the same time)."""
    topo = leafspine(4)
    workers, server, _ = _names(topo)
    traffic = {(w, server.name): 100.0 for w in workers} | {(server.name, w): 100.0 for w in workers}
    free = line_rate_bound(topo, traffic, 100)
    assert free.seconds == pytest.approx(1.0) and free.port is not None and free.port[0] != server.name  # an uplink
    paced = line_rate_bound(topo, traffic, 100, host_pps=100)
    assert (paced.seconds, paced.port, paced.packets) == (pytest.approx(4.0), (server.name, 0), 400)
    assert paced.loads[(workers[0], 0)] == 100  # every sender counted, at its own rate
    assert line_rate_bound(topo, traffic, 100, host_pps=800).seconds == pytest.approx(1.0)  # a faster host: the fabric


def test_capped_host_ports_are_bottlenecks_of_the_job_hosts_only():
    topo = leafspine(4)
    assert with_host_ports(topo, "free") is topo
    capped = with_host_ports(topo, "capped")
    job = {(h.switch, h.port) for h in topo.hosts if h.role in ("worker", "server")}
    assert capped.bottlenecks == topo.bottlenecks | job and len(job) == 5
    assert not {(h.switch, h.port) for h in topo.role("cross")} & capped.bottlenecks  # other tenants stay free
    workers, server, _ = _names(capped)
    incast = line_rate_bound(capped, {(w, server.name): 100.0 for w in workers}, 100)
    assert (incast.seconds, incast.port) == (pytest.approx(4.0), (server.switch, server.port))  # the server's port
    net = capped.network("/tmp", 100, 64)
    assert net["switches"][server.switch]["ports"][server.port]["capacity_pps"] == 100
    with pytest.raises(ValueError, match="host_ports"):
        with_host_ports(topo, "fast")
    with pytest.raises(UsageError, match="--host-ports 'fast'"):
        RunOptions(host_ports="fast").validate()
