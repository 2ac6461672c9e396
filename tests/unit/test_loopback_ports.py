"""Ports for peers on one machine: picked where no outgoing connection can take them."""

from __future__ import annotations

import socket

from dlcp.hostagent import loopback


def test_picked_ports_are_distinct_free_for_udp_and_tcp_and_below_the_ephemeral_range():
    """A port from the kernel's ephemeral range could be taken by any process's connect()
    before its user bound it: the testbed's gloo agents once failed to listen on their store
    port in a full test run (EADDRINUSE, ``tests/shim/test_testbed_ddp_agent.py``)."""
    span = loopback._pick_range()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    pairs = loopback.free_port_pairs(4)
    ports = [p for pair in pairs for p in pair] + list(loopback.free_tcp_ports(3)) + [loopback.free_shared_port()]
    assert len(set(ports[:8])) == 8
    for p in ports:
        if span is not None:
            assert span[0] <= p < ephemeral_low, (p, span)
        for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
            with socket.socket(socket.AF_INET, kind) as s:
                s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_picked(monkeypatch):
    """The pick checks each number with a bind: one held by a listener is skipped."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        free = next(p for p in range(20000, 65535) if p != busy and loopback._bindable(p, "127.0.0.1"))
        choices = iter([busy, busy, free])
        monkeypatch.setattr(loopback, "_pick_range", lambda: (1, 2))
        monkeypatch.setattr(loopback.random.SystemRandom, "randint", lambda self, a, b: next(choices))
        assert loopback.free_tcp_ports(1) == (free,)


def test_a_rendezvous_rank_receives_on_a_port_dlcps_switches_parse_while_one_is_free():
    """The backend's ranks bind their data sockets with ``reserve_ports``: DLCP's default port,
    then the rest of its block of 16 (the ports the P4 parser takes as DLCP), so ranks sharing an
    address each get one; a 17th gets any free port and a note that switches will not see DLCP."""
    from dlcp.hostagent import wire
    from dlcp.hostagent.transport import data_port_note, reserve_ports

    host = "127.0.0.77"  # (all of 127/8 is loopback: an address no other test binds)
    held = []
    try:
        for _ in range(len(wire.dlcp_ports()) + 1):
            held.append(reserve_ports(host))
        ports = [udp.getsockname()[1] for udp, _ in held]
        assert ports[:-1] == wire.dlcp_ports() and ports[0] == wire.DLCP_UDP_PORT
        assert all(data_port_note(p) is None for p in ports[:-1])
        assert not wire.is_dlcp_port(ports[-1]) and "plain UDP" in (data_port_note(ports[-1]) or "")
    finally:
        for udp, tcp in held:
            udp.close()
            tcp.close()
