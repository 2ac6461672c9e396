"""The scheduler of a bottleneck port: one capacity, strict priority, on the port's egress interface.

Why not BMv2's queues: BMv2 rate-limits each priority queue of a port on its own
(``QueueingLogicPriRL``: every queue has its own rate, the dequeue takes the highest queue
whose head is due), so a port of "capacity R" with two backlogged priorities sends 2R,
interleaved. No BMv2 setting gives one port of capacity R served by priority. So a
bottleneck port's BMv2 queues are left unlimited and its scheduler is an HTB tree on the
switch-side interface the port transmits on, the part a hardware switch's traffic manager
plays behind its pipeline:

* the root qdisc, handle :data:`HANDLE` (DLCP's mark: ``dlcp clean`` removes exactly these);
* one class at the port's capacity R (rate = ceil = R) with a burst of half a full-size frame
  (:attr:`PortScheduler.burst`): HTB sends while its tokens are not negative, so after an
  idle spell one frame leaves at once, as on a link, and the next waits (a burst of a whole
  slot let two full-size frames out back to back); the half slot of credit absorbs a timer
  that fires late on a busy machine (with a burst of 1 byte a 1 Mbit/s port served 98 % of R
  here), at the price of up to half a full-size frame's bytes early after an idle spell;
* eight leaves, one per switch queue q, each ``rate 8bit ceil R prio 7-q``: HTB lends the
  parent's rate to the leaf of the lowest ``prio`` first, so queue 7 is served first and a
  lower queue only when every higher one is empty, and all together never above R;
* a FIFO under each leaf, deep enough never to drop what the P4 program admitted;
* u32 filters that send a frame to the leaf of the queue the P4 program chose for it, read
  from the low 3 bits of its source MAC (``TM_TAG_BITS`` in ``p4/include/defines.p4``: the
  switch writes the source MAC itself on every hop, and nobody downstream reads those bits).

The P4 program keeps deciding each packet's priority, selective drop and ECN mark, against a
virtual copy of this scheduler's queues that drains at the same rate and charges each packet
the same (``p4/include/control/priority_queue.p4``); only what it admits reaches the tree.

**Cost of a frame.** HTB counts bytes: a frame of ``len`` bytes (as the kernel sees it:
Ethernet header, no FCS) costs ``max(len + overhead, mpu)`` bytes of the rate (:class:`Charge`).
A capacity in bits per second charges what the frame costs on an Ethernet wire (+24 bytes:
FCS, preamble, inter-frame gap; at least 84 bytes), so a TCP ACK costs an ACK. A capacity in
packets per second charges every frame one *slot*, a full-size frame's bytes (``mpu`` = the
slot, overhead 0), so each frame, ACK or not, costs the same, as BMv2's packet rates did.
Buffers and thresholds are in slots in both cases.

**Known deviation**: HTB needs each leaf to have a positive rate of its own (8 bit/s here). A
leaf whose own tokens are positive sends without borrowing, before any borrowing leaf; its
tokens refill in time, so each leaf may send one frame out of priority order about once a
minute (HTB caps a class's debt at 60 s), charged to the port's capacity like any other.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import socket
import struct
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dlcp.hostagent.errors import DlcpUserError

log = logging.getLogger(__name__)

#: Root qdisc handle (major, hex) of every scheduler DLCP installs: how ``dlcp clean`` knows its own.
HANDLE = "d1c9"
#: Bytes a frame occupies on an Ethernet wire beyond what the kernel counts: FCS 4, preamble and
#: start delimiter 8, inter-frame gap 12.
WIRE_OVERHEAD = 24
#: The shortest Ethernet frame on the wire: 64 bytes with FCS, plus preamble and gap.
MIN_WIRE_FRAME = 84
ETH_HEADER = 14
NUM_QUEUES = 8
#: The guaranteed rate of each leaf: HTB needs a positive one; the smallest it takes.
LEAF_RATE_BITS = 8
#: Frames each leaf's FIFO may hold at least (BMv2's queues' depth, ``priority_queue.REAL_QUEUE_DEPTH``).
MIN_FIFO = 1024


_BIT_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def parse_capacity(text: str) -> tuple[int, int]:
    """A capacity as ``(packets per second, bits per second)``, one of them 0: ``600`` or
    ``600pps`` is 600 frames per second, each a slot whatever its size; ``7.4mbit`` (also
    ``bit``, ``kbit``, ``gbit``; decimal, as tc's) is bits per second on the wire.

    Raises:
        ValueError: names the forms accepted.
    """
    t = text.strip().lower()
    try:
        for unit in sorted(_BIT_UNITS, key=len, reverse=True):
            if t.endswith(unit):
                bps = float(t[:-len(unit)]) * _BIT_UNITS[unit]
                if not math.isfinite(bps) or bps < 1:
                    raise ValueError
                return 0, round(bps)
        pps = float(t[:-3] if t.endswith("pps") else t)
        if pps != int(pps) or pps < 1:
            raise ValueError
        return int(pps), 0
    except ValueError:
        raise ValueError(f"capacity {text!r}: give packets per second (600, 600pps) or bits per second on the wire "
                         "(7.4mbit, 500kbit, 1gbit)") from None


class SchedulerError(DlcpUserError):
    """``tc`` refused the scheduler, or is missing, or an interface is not there; the message
    says which (``dlcpctl`` and ``dlcp run`` print it as one line)."""


@dataclass(frozen=True)
class Charge:
    """What a port charges a frame of ``len`` bytes (Ethernet header included, no FCS):
    ``max(len + overhead, mpu)`` bytes; ``slot`` is a full-size frame's charge, the unit of
    buffers, thresholds and of the virtual queue."""

    overhead: int
    mpu: int
    slot: int

    def cost(self, frame_len: int) -> int:
        return max(frame_len + self.overhead, self.mpu)

    @property
    def smallest(self) -> int:
        """The least any frame costs (an Ethernet frame is at least 60 bytes without FCS)."""
        return self.cost(60)


def slot_bytes(mtu: int) -> int:
    """A full-size frame of an ``mtu``-byte interface on the wire: header, FCS, preamble, gap."""
    return mtu + ETH_HEADER + WIRE_OVERHEAD


def charge(bits: bool, mtu: int = 1500) -> Charge:
    """The charge of a port whose capacity is in bits per second (``bits``) or in packets."""
    slot = slot_bytes(mtu)
    return Charge(WIRE_OVERHEAD, MIN_WIRE_FRAME, slot) if bits else Charge(0, slot, slot)


@dataclass(frozen=True)
class PortScheduler:
    """The scheduler of one bottleneck port (everything :func:`tc_batch` needs)."""

    interface: str
    rate_bits: int
    """The port's capacity in bits per second of charged bytes (:class:`Charge`)."""
    charge: Charge
    buffer: int
    """Slots the P4 program admits at most (its virtual queue's buffer)."""

    @property
    def slots_per_second(self) -> float:
        return self.rate_bits / 8 / self.charge.slot

    @property
    def burst(self) -> int:
        """Bytes of credit the port may run ahead of its rate: half a full-size frame."""
        return self.charge.slot // 2

    @property
    def fifo_limit(self) -> int:
        """Frames per leaf: twice the most the virtual buffer can admit (small frames count
        less than a slot), at least :data:`MIN_FIFO`, so the real queue never drops what the
        pipeline admitted; a drop here is a loss no P4 counter sees, which a run reports."""
        return max(MIN_FIFO, 2 * math.ceil(self.buffer * self.charge.slot / self.charge.smallest))


def leaf(queue: int) -> str:
    """The class id of switch queue ``queue``'s leaf (tc's minor numbers are hex)."""
    return f"{HANDLE}:{0x10 + queue:x}"


def tc_batch(port: PortScheduler, with_root: bool) -> list[str]:
    """The ``tc -batch`` lines that install or update ``port``'s tree (``with_root``: create the
    root qdisc too, which ``tc`` cannot change in place; every other line is a ``replace``, so
    applying them again changes nothing and keeps what is queued)."""
    dev, r, c, b = port.interface, port.rate_bits, port.charge, port.burst
    cost = f"mpu {c.mpu} overhead {c.overhead}"
    lines = [f"qdisc replace dev {dev} root handle {HANDLE}: htb default {0x10:x}"] if with_root else []
    lines.append(f"class replace dev {dev} parent {HANDLE}: classid {HANDLE}:1 htb rate {r}bit ceil {r}bit "
                 f"burst {b}b cburst {b}b {cost}")
    for q in range(NUM_QUEUES):
        lines += [f"class replace dev {dev} parent {HANDLE}:1 classid {leaf(q)} htb rate {LEAF_RATE_BITS}bit "
                  f"ceil {r}bit burst 1b cburst {b}b prio {NUM_QUEUES - 1 - q} quantum {c.slot} {cost}",
                  f"qdisc replace dev {dev} parent {leaf(q)} handle {0x20 + q:x}: pfifo limit {port.fifo_limit}",
                  # the tag is the low 3 bits of the source MAC's last byte: 3 bytes before the IP header
                  f"filter replace dev {dev} parent {HANDLE}: protocol all prio 1 handle 800::{0x800 + q:x} "
                  f"u32 match u8 {q} 0x07 at -3 flowid {leaf(q)}"]
    return lines


# --- I/O: tc --------------------------------------------------------------------------------

def _tc(args: Sequence[str], netns: str | None, stdin: str | None = None) -> subprocess.CompletedProcess:
    if shutil.which("tc") is None:
        raise SchedulerError("tc (iproute2) is not installed: it installs the bottleneck ports' schedulers")
    cmd = ["tc", *(["-n", netns] if netns else []), *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True)


def _json_objects(text: str) -> list[dict]:
    """Every object of the JSON arrays ``tc -j`` printed (one array per batch command)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        value, i = dec.raw_decode(text, i)
        out += value if isinstance(value, list) else [value]
    return out


def root_qdiscs(netns: str | None) -> dict[str, dict]:
    """Per interface of the namespace: its root qdisc as ``tc -s -j`` shows it (kind, handle, stats)."""
    res = _tc(["-s", "-j", "qdisc", "show"], netns)
    if res.returncode != 0:
        raise SchedulerError(f"tc qdisc show{' in netns ' + netns if netns else ''}: {res.stderr.strip()}")
    return {q["dev"]: q for q in _json_objects(res.stdout) if q.get("root")}


def ours(qdisc: Mapping) -> bool:
    return qdisc.get("kind") == "htb" and qdisc.get("handle") == f"{HANDLE}:"


def install(ports: Iterable[PortScheduler], netns: str | None) -> int:
    """Install or update the schedulers of ``ports`` (interfaces of namespace ``netns``) in one
    ``tc -batch``; returns how many ports. A port whose root qdisc is someone else's is taken
    over (its root replaced); one that already has DLCP's tree is updated in place.

    Raises:
        SchedulerError: tc is missing or refused a line (the message quotes it).
    """
    ports = list(ports)
    if not ports:
        return 0
    roots = root_qdiscs(netns)
    missing = [p.interface for p in ports if p.interface not in roots]
    if missing:
        where = f"network namespace {netns}" if netns else "this network namespace"
        raise SchedulerError(f"no interface {', '.join(missing)} in {where}: a bottleneck port's `interface` must "
                             "name the switch-side interface its BMv2 port transmits on")
    lines = [line for p in ports for line in tc_batch(p, with_root=not ours(roots[p.interface]))]
    res = _tc(["-batch", "-"], netns, "\n".join(lines) + "\n")
    if res.returncode != 0:
        raise SchedulerError(f"tc -batch{' -n ' + netns if netns else ''} refused the scheduler: "
                             f"{res.stderr.strip()}")
    log.info("scheduler: %d port(s) in %s: %s", len(ports), netns or "this namespace",
             ", ".join(f"{p.interface} {p.rate_bits} bit/s" for p in ports))
    return len(ports)


def remove(netns: str | None) -> list[str]:
    """Remove every DLCP scheduler (root qdisc :data:`HANDLE`) of namespace ``netns``, and
    nothing else; returns the interfaces it was removed from."""
    try:
        roots = root_qdiscs(netns)
    except SchedulerError:
        return []
    gone = []
    for dev, q in sorted(roots.items()):
        if ours(q) and _tc(["qdisc", "del", "dev", dev, "root"], netns).returncode == 0:
            gone.append(dev)
    return gone


# --- I/O: reading a scheduler's counters cheaply, over netlink -------------------------------------

@dataclass(frozen=True)
class QdiscStats:
    """A root qdisc's counters: cumulative bytes, packets and drops; the backlog right now."""

    bytes: int
    packets: int
    drops: int
    qlen: int
    backlog: int


_RTM_NEWQDISC, _RTM_GETQDISC, _NLMSG_ERROR, _NLMSG_DONE = 36, 38, 2, 3
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_TCA_KIND, _TCA_STATS2, _TCA_STATS_BASIC, _TCA_STATS_QUEUE = 1, 7, 1, 3
_TC_H_ROOT = 0xFFFFFFFF


def _attrs(buf: bytes, off: int, end: int) -> dict[int, bytes]:
    out = {}
    while off + 4 <= end:
        length, kind = struct.unpack_from("=HH", buf, off)
        if length < 4:
            break
        out[kind & 0x3FFF] = buf[off + 4:off + length]
        off += (length + 3) & ~3
    return out


def parse_qdisc_dump(messages: bytes) -> dict[int, QdiscStats]:
    """Per interface index: the stats of DLCP's root qdisc, from a RTM_GETQDISC dump's replies."""
    out, off = {}, 0
    handle = int(HANDLE, 16) << 16
    while off + 16 <= len(messages):
        length, kind = struct.unpack_from("=IH", messages, off)
        if length < 16:
            break
        if kind == _RTM_NEWQDISC:
            _, _, _, ifindex, tc_handle, parent, _ = struct.unpack_from("=BBHiIII", messages, off + 16)
            attrs = _attrs(messages, off + 36, off + length)
            if tc_handle == handle and parent == _TC_H_ROOT and attrs.get(_TCA_KIND, b"").rstrip(b"\0") == b"htb":
                stats = _attrs(attrs.get(_TCA_STATS2, b""), 0, len(attrs.get(_TCA_STATS2, b"")))
                nbytes, packets = struct.unpack_from("=QI", stats[_TCA_STATS_BASIC]) \
                    if len(stats.get(_TCA_STATS_BASIC, b"")) >= 12 else (0, 0)
                qlen, backlog, drops = struct.unpack_from("=III", stats[_TCA_STATS_QUEUE]) \
                    if len(stats.get(_TCA_STATS_QUEUE, b"")) >= 12 else (0, 0, 0)
                out[ifindex] = QdiscStats(nbytes, packets, drops, qlen, backlog)
        off += (length + 3) & ~3
    return out


class QdiscReader:
    """Reads the counters of DLCP's schedulers in one network namespace, a netlink dump per call
    (about a tenth of a millisecond, where running ``tc`` costs milliseconds of CPU)."""

    def __init__(self, netns: str | None, interfaces: Sequence[str]) -> None:
        from dlcp.controller.bmv2_thrift import in_netns

        self.netns = netns
        self.sock = in_netns(netns, lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
        self.sock.bind((0, 0))
        self.index = in_netns(netns, lambda: {i: socket.if_nametoindex(i) for i in interfaces})
        self._seq = 0

    def read(self) -> dict[str, QdiscStats]:
        """Per interface: its DLCP scheduler's counters (an interface without one is left out)."""
        self._seq += 1
        req = struct.pack("=IHHII", 36, _RTM_GETQDISC, _NLM_F_REQUEST | _NLM_F_DUMP, self._seq, 0)
        self.sock.send(req + struct.pack("=BBHiIII", socket.AF_UNSPEC, 0, 0, 0, 0, 0, 0))
        chunks = []
        while True:
            data = self.sock.recv(1 << 16)
            chunks.append(data)
            done, off = False, 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, off)
                if kind in (_NLMSG_DONE, _NLMSG_ERROR):
                    done = True
                off += max(16, (length + 3) & ~3)
            if done:
                break
        stats = parse_qdisc_dump(b"".join(chunks))
        return {name: stats[i] for name, i in self.index.items() if i in stats}

    def close(self) -> None:
        self.sock.close()
