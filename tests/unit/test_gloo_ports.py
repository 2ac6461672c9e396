"""gloo's fixed ports in the testbed (:mod:`dlcp.topologies.gloo_ports`): which side opens each
connection, from which port, and how a run reads them back. Pure parts; the namespaces' side is
tests/testbed/test_gloo_ports.py."""

from __future__ import annotations

import pytest

from dlcp.topologies.gloo_ports import Connection, GlooPorts, expected_connections, initiates, parse_connections


def test_a_range_is_two_ports_the_first_even():
    p = GlooPorts(20514)
    assert (p.connect, p.listen) == (20514, 20515)
    assert p.sysctls() == {"net.ipv4.ip_local_port_range": "20514 20515"}
    for bad in (20515, 80, 65535):
        with pytest.raises(ValueError, match=f"GlooPorts.connect={bad}: needs an even port"):
            GlooPorts(bad)


def test_the_higher_address_opens_the_connection():
    # gloo compares the two addresses' bytes: 10.0.0.10 is above 10.0.0.9 (not as strings)
    assert initiates("10.0.0.10", "10.0.0.9") and not initiates("10.0.0.9", "10.0.0.10")
    with pytest.raises(ValueError, match="share a range"):
        initiates("127.0.0.1", "127.0.0.1")
    with pytest.raises(ValueError, match="one address family"):
        initiates("10.0.0.1", "::1")


def test_every_direction_of_every_pair_is_known():
    ips = ["10.0.1.1", "10.0.2.1", "10.0.0.5"]
    conns = expected_connections(ips, GlooPorts(40000))
    assert len(conns) == 6 and len(set(conns)) == 6
    # 10.0.2.1 opens both of its connections, from the even port, to the others' listeners
    assert Connection("10.0.2.1", "10.0.1.1", 40000, 40001) in conns
    assert Connection("10.0.1.1", "10.0.2.1", 40001, 40000) in conns  # the reply direction
    assert Connection("10.0.0.5", "10.0.1.1", 40001, 40000) in conns  # 10.0.0.5 is the lowest: listens
    for c in conns:  # each direction's reverse is there with the ports swapped
        assert Connection(c.dst, c.src, c.dport, c.sport) in conns


def test_connections_read_from_ss():
    out = ("0      0      10.0.1.1:40001   10.0.2.1:40000\n"
           "0      0      [::ffff:10.0.1.1]:29500   [::ffff:10.0.2.1]:40000  users:((\"python\",pid=1,fd=3))\n"
           "\n")
    assert parse_connections(out) == [Connection("10.0.1.1", "10.0.2.1", 40001, 40000),
                                      Connection("::ffff:10.0.1.1", "::ffff:10.0.2.1", 29500, 40000)]
    assert parse_connections("") == []
