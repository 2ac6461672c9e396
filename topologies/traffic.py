"""Cross traffic for testbed runs: UDP and TCP senders with an on/off pattern, and sinks.

    python -m dlcp.topologies.traffic sink PORT
    python -m dlcp.topologies.traffic udp DST PORT RATE_PPS ON_S OFF_S DURATION_S [--dscp N]
    python -m dlcp.topologies.traffic tcp DST PORT ON_S OFF_S DURATION_S [--dscp N]

UDP sends 1000-byte datagrams at RATE_PPS during "on" periods; TCP sends as fast as the
network lets it during "on" periods (one connection, so per-flow ECMP keeps it on one path).
OFF_S 0 means always on. ``--dscp`` marks the senders' packets (IP TOS = DSCP << 2) so the
switches put them in the priority queue the network file maps that DSCP to.

The runner stops these with SIGTERM to the process group. Every role then (or when a sender
reaches DURATION_S) prints one JSON summary line on stdout and exits 0, so a run's
cross-traffic logs say what other tenants sent and got: :func:`read_summaries` parses such a
log, :func:`summarise` turns the senders' and sinks' lines of one scheme into delivered
rates, UDP loss and TCP goodput. Stamps are ``time.monotonic()``: one clock for every process
on the machine, comparable with the agents' stamps. Bad arguments: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

UDP_PAYLOAD = 1000
TCP_CHUNK = 16384
NAP_S = 0.05
"""Longest any loop here blocks without looking at the stop flag: bounds the exit latency."""
JOIN_S = 0.3
"""How long a stopping sink waits for its receiving threads, so their counts are final."""
SINK_RCVBUF = 4 << 20
"""Sink UDP receive buffer, so a burst while its thread is descheduled is not dropped at the
sink and misread as network loss (the kernel caps it at net.core.rmem_max)."""


# ---------------------------------------------------------------------------- stopping


class StopFlag:
    """Set by SIGTERM/SIGINT. The handler only sets a flag, never raises, so a signal cannot land
    between sending a packet and counting it (which would let a sink see more than was sent).
    Every blocking call in this module is bounded by ``NAP_S``, so loops see the flag at once."""

    def __init__(self) -> None:
        self.stopped = False

    def set(self, *_: object) -> None:
        self.stopped = True

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.set)

    def sleep_until(self, deadline: float) -> None:
        """Sleep until the monotonic ``deadline`` in short naps, returning early on a stop."""
        while not self.stopped:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, NAP_S))


# ---------------------------------------------------------------------------- on/off pattern


def is_on(elapsed: float, on: float, off: float) -> bool:
    """Whether ``elapsed`` seconds into the pattern fall in an "on" period (off <= 0: always on)."""
    return off <= 0 or elapsed % (on + off) < on


def on_time(elapsed: float, on: float, off: float) -> float:
    """Seconds of "on" periods in the first ``elapsed`` seconds: the time a sender was trying to
    send, the denominator of its achieved rate and of TCP goodput."""
    if off <= 0 or math.isinf(on):
        return elapsed
    full, rest = divmod(elapsed, on + off)
    return full * on + min(rest, on)


# ---------------------------------------------------------------------------- sockets


def open_socket(proto: str, dscp: int = 0, sport: int = 0) -> socket.socket:
    """An IPv4 sender socket whose packets carry ``dscp``: the switches map DSCP to a priority
    queue, so this chooses the queue the cross traffic competes in. ECN bits are left 0.

    With ``sport`` it sends from that source port, so a flow-hashing switch gives it the same
    path in every run with that port (the runner pairs schemes of a repetition this way). A TCP
    socket then closes with a reset, leaving no TIME_WAIT that would keep the next run from
    connecting from the same port to the same sink."""
    if not 0 <= dscp <= 63:
        raise ValueError(f"dscp must be in 0..63, got {dscp}")
    kind = {"udp": socket.SOCK_DGRAM, "tcp": socket.SOCK_STREAM}[proto]
    s = socket.socket(socket.AF_INET, kind)
    try:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
        if sport:
            if proto == "tcp":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.bind(("0.0.0.0", sport))
    except OSError:
        s.close()
        raise
    return s


def source_address(dst: str) -> str | None:
    """The local address the kernel routes to ``dst`` from, i.e. how the sink will see this
    sender (its per-source counts are keyed by it). Connecting a UDP socket sends nothing."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((dst, 9))
            return probe.getsockname()[0]
    except OSError:
        return None


def tcp_info(s: socket.socket) -> dict:
    """Segments, retransmissions and acked bytes from Linux's TCP_INFO: what the sender's own
    socket saw of the network. Offsets are those of ``struct tcp_info`` (linux/tcp.h, fields
    only ever appended); empty if the kernel does not give that much."""
    try:
        raw = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except (OSError, AttributeError):
        return {}
    if len(raw) < 160:
        return {}
    return {"sent_pkts": struct.unpack_from("=I", raw, 156)[0],  # tcpi_data_segs_out
            "retrans_pkts": struct.unpack_from("=I", raw, 100)[0],  # tcpi_total_retrans
            "acked_bytes": struct.unpack_from("=Q", raw, 120)[0]}  # tcpi_bytes_acked


# ---------------------------------------------------------------------------- senders


def _sender_summary(proto: str, args: argparse.Namespace, src: str | None, start: float, end: float,
                    **fields: object) -> dict:
    return {"role": "sender", "proto": proto, "src": src, "sport": args.sport or None, "dst": args.dst,
            "port": args.port, "dscp": args.dscp, **fields, "active_s": on_time(end - start, args.on, args.off),
            "start": start, "end": end}


def run_udp(args: argparse.Namespace, stop: StopFlag) -> dict:
    """Paced datagrams during "on" periods. The schedule advances through "off" periods too,
    so a new "on" period starts at the rate instead of with a burst."""
    payload, addr, gap = bytes(UDP_PAYLOAD), (args.dst, args.port), 1.0 / args.rate
    src = source_address(args.dst)
    sent = errors = 0
    with open_socket("udp", args.dscp, args.sport) as s:
        s.settimeout(NAP_S)
        start = next_t = time.monotonic()
        while not stop.stopped:
            elapsed = time.monotonic() - start
            if elapsed >= args.duration:
                break
            if is_on(elapsed, args.on, args.off):
                try:
                    s.sendto(payload, addr)
                    sent += 1
                except OSError:  # full send buffer (timeout), no route, ...: not sent
                    errors += 1
            next_t += gap
            stop.sleep_until(next_t)
        end = time.monotonic()
    active = on_time(end - start, args.on, args.off)
    return _sender_summary("udp", args, src, start, end, sent_pkts=sent, sent_bytes=sent * UDP_PAYLOAD,
                           send_errors=errors, rate_pps=args.rate,
                           achieved_pps=sent / active if active > 0 else 0.0)


def _wait_connected(s: socket.socket, stop: StopFlag, deadline: float) -> int | None:
    """The connect's errno (0: connected), or None on a stop or at the deadline."""
    while not stop.stopped and time.monotonic() < deadline:
        if select.select([], [s], [], NAP_S)[1]:
            return s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    return None


def _connect(args: argparse.Namespace, stop: StopFlag, deadline: float) -> tuple[socket.socket | None, str]:
    """Connect, retrying while the sink is not up yet. Non-blocking, so a stop during a slow
    handshake is seen at once and the kernel keeps its own SYN retries."""
    error = "not connected"
    while not stop.stopped and time.monotonic() < deadline:
        s = open_socket("tcp", args.dscp, args.sport)
        s.setblocking(False)
        s.connect_ex((args.dst, args.port))
        code = _wait_connected(s, stop, deadline)
        if code == 0:
            return s, ""
        s.close()
        if code is None:
            break
        error = f"connect: {os.strerror(code)}"
        stop.sleep_until(min(time.monotonic() + 0.1, deadline))
    return None, error


def run_tcp(args: argparse.Namespace, stop: StopFlag) -> dict:
    """One connection, written as fast as it drains during "on" periods. DURATION_S counts from
    launch; ``start`` and the on/off clock from the connection (data cannot flow before)."""
    deadline = time.monotonic() + args.duration
    s, error = _connect(args, stop, deadline)
    start = time.monotonic()
    sent, src, info = 0, None, {}
    if s is not None:
        with s:
            src = s.getsockname()[0]
            s.settimeout(NAP_S)
            chunk = bytes(TCP_CHUNK)
            while not stop.stopped and (now := time.monotonic()) < deadline:
                if not is_on(now - start, args.on, args.off):
                    stop.sleep_until(min(now + 0.01, deadline))
                    continue
                try:
                    sent += s.send(chunk)
                except TimeoutError:  # the network is the bottleneck: try again
                    continue
                except OSError as exc:  # the sink went away
                    error = f"send: {exc.strerror or exc}"
                    break
            info = tcp_info(s)
    end = time.monotonic()
    summary = _sender_summary("tcp", args, src, start, end, sent_bytes=sent,
                              sent_pkts=info.get("sent_pkts"), retrans_pkts=info.get("retrans_pkts"),
                              acked_bytes=info.get("acked_bytes"))
    if error:
        summary["error"] = error
    return summary


# ---------------------------------------------------------------------------- sink


class _Tally:
    """Counts of one UDP source or one TCP connection. Each tally is written by exactly one
    thread, with no lock (plain attribute updates), and read by the main thread after that
    thread has stopped."""

    __slots__ = ("bytes", "first", "last", "pkts")

    def __init__(self) -> None:
        self.pkts = 0
        self.bytes = 0
        self.first: float | None = None
        self.last: float | None = None


def _tallies_dict(proto: str, tallies: Sequence[_Tally]) -> dict:
    """Totals and first/last arrival of some tallies: a protocol's or one source's."""
    out: dict = {"received_bytes": sum(t.bytes for t in tallies)}
    if proto == "udp":
        out["received_pkts"] = sum(t.pkts for t in tallies)
    else:
        out["connections"] = len(tallies)
    out["first_arrival"] = min((t.first for t in tallies if t.first is not None), default=None)
    out["last_arrival"] = max((t.last for t in tallies if t.last is not None), default=None)
    return out


def _proto_dict(proto: str, by_source: Iterable[tuple[str, _Tally]]) -> dict:
    groups: dict[str, list[_Tally]] = {}
    for src, tally in by_source:
        groups.setdefault(src, []).append(tally)
    out = _tallies_dict(proto, [t for ts in groups.values() for t in ts])
    out["sources"] = {src: _tallies_dict(proto, ts) for src, ts in sorted(groups.items())}
    return out


class Sink:
    """Receives UDP and TCP on one port and counts per protocol and source address (a sink may
    receive from two senders). UDP is drained by one thread, each TCP connection by its own."""

    def __init__(self, port: int, stop: StopFlag) -> None:
        self.port, self.stop = port, stop
        self.udp_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SINK_RCVBUF)
        self.udp_sock.bind(("0.0.0.0", port))
        self.tcp_sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp_sock.bind(("0.0.0.0", port))
        self.tcp_sock.listen(8)
        self.udp: dict[str, _Tally] = {}
        self.tcp: list[tuple[str, _Tally]] = []
        self.threads: list[threading.Thread] = []
        self.start = self.end = time.monotonic()

    def run(self) -> dict:
        """Receive until stopped; then let the threads finish and summarise."""
        self._spawn(self._drain_udp)
        self.tcp_sock.settimeout(NAP_S)
        while not self.stop.stopped:
            try:
                conn, (ip, _) = self.tcp_sock.accept()
            except TimeoutError:
                continue
            tally = _Tally()
            self.tcp.append((ip, tally))
            self._spawn(self._drain_tcp, conn, tally)
        deadline = time.monotonic() + JOIN_S
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.end = time.monotonic()
        self.udp_sock.close()
        self.tcp_sock.close()
        return self.summary()

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def _drain_udp(self) -> None:
        buf, counts, stop, sock = bytearray(65536), self.udp, self.stop, self.udp_sock
        sock.settimeout(NAP_S)
        while not stop.stopped:
            try:
                n, (ip, _) = sock.recvfrom_into(buf)
            except TimeoutError:
                continue
            except OSError:
                return
            now = time.monotonic()
            tally = counts.get(ip)
            if tally is None:
                tally = counts[ip] = _Tally()
                tally.first = now
            tally.pkts += 1
            tally.bytes += n
            tally.last = now

    def _drain_tcp(self, conn: socket.socket, tally: _Tally) -> None:
        buf, stop = bytearray(65536), self.stop
        with conn:
            conn.settimeout(NAP_S)
            while not stop.stopped:
                try:
                    n = conn.recv_into(buf)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if n == 0:
                    return
                now = time.monotonic()
                if tally.first is None:
                    tally.first = now
                tally.bytes += n
                tally.last = now

    def summary(self) -> dict:
        return {"role": "sink", "port": self.port, "start": self.start, "end": self.end,
                "udp": _proto_dict("udp", dict(self.udp).items()),
                "tcp": _proto_dict("tcp", list(self.tcp))}


def run_sink(args: argparse.Namespace, stop: StopFlag) -> dict:
    return Sink(args.port, stop).run()


# ---------------------------------------------------------------------------- summaries


def read_summaries(path: str | os.PathLike) -> list[dict]:
    """The JSON objects of a cross-traffic log, one a line. Other lines (a traceback: the logs
    also take stderr) are skipped; a missing or empty file gives []."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num(d: dict, key: str) -> float:
    """``d[key]`` if it is a number, else 0: a summary may lack a field (an error, an old log)."""
    v = d.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _received(senders: list[dict], sinks: list[dict]) -> tuple[list[dict], bool]:
    """The sink rows that count these senders' traffic: each sink's per-source row for every
    sender's source address when all senders know theirs and all sinks count per source
    (stray traffic is then left out); otherwise the sinks' totals."""
    srcs = {s.get("src") for s in senders}
    known = sorted(src for src in srcs if src is not None)
    if senders and len(known) == len(srcs) and all(isinstance(k.get("sources"), dict) for k in sinks):
        return [k["sources"][src] for k in sinks for src in known if src in k["sources"]], True
    return sinks, False


def _summarise_proto(proto: str, senders: list[dict], sinks: list[dict]) -> dict:
    rows, matched = _received(senders, sinks)
    starts = [s["start"] for s in senders if _is_num(s.get("start"))]
    ends = [s["end"] for s in senders if _is_num(s.get("end"))]
    window = max(ends) - min(starts) if starts and ends else None
    active = max((_num(s, "active_s") for s in senders), default=0) or None
    have_sink = bool(sinks)
    bytes_ = sum(_num(r, "received_bytes") for r in rows) if have_sink else None
    out: dict = {"senders": len(senders), "sent_bytes": sum(_num(s, "sent_bytes") for s in senders),
                 "delivered_bytes": bytes_, "window_s": window, "active_s": active,
                 "matched_by_source": matched if have_sink else None}
    if proto == "udp":
        sent_pkts = sum(_num(s, "sent_pkts") for s in senders)
        pkts = sum(_num(r, "received_pkts") for r in rows) if have_sink else None
        out.update(sent_pkts=sent_pkts, delivered_pkts=pkts,
                   delivered_pps=pkts / window if pkts is not None and window else None,
                   loss=max(0.0, 1.0 - pkts / sent_pkts) if pkts is not None and sent_pkts else None)
    else:
        mbits = bytes_ * 8 / 1e6 if bytes_ is not None else None
        out.update(connections=sum(_num(r, "connections") for r in rows) if have_sink else None,
                   retrans_pkts=sum(_num(s, "retrans_pkts") for s in senders),
                   delivered_mbps=mbits / window if mbits is not None and window else None,
                   goodput_mbps=mbits / active if mbits is not None and active else None)
    return out


def summarise(sent: list[dict], received: list[dict]) -> dict:
    """What the cross traffic of one scheme got: the cost DLCP imposes on other tenants.

    ``sent``: the senders' summaries, ``received``: the sinks'. Per protocol present:
    delivered bytes (and packets for UDP) as counted by the sinks, matched to the senders by
    source address where possible; ``delivered_pps`` (UDP) / ``delivered_mbps`` (TCP) over
    ``window_s``, the senders' earliest start to latest end; UDP ``loss`` = 1 - delivered/sent
    (clamped at 0); TCP ``goodput_mbps`` over ``active_s``, the longest "on" time of a sender
    (the senders of a scheme run at once). Figures that need a sink are None without one."""
    out = {}
    for proto in ("udp", "tcp"):
        senders = [s for s in sent if s.get("proto") == proto]
        sinks = [r[proto] for r in received if isinstance(r.get(proto), dict)]
        if senders or any(_num(k, "received_bytes") for k in sinks):
            out[proto] = _summarise_proto(proto, senders, sinks)
    return out


# ---------------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the runner's logs and the user read them), exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _checked(convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse type: ``convert`` the text, and refuse it (one line) unless ``ok``."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    return parse


_port = _checked(int, lambda v: 1 <= v <= 65535, "an integer in 1..65535")
_rate = _checked(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
_seconds = _checked(float, lambda v: not math.isnan(v) and v >= 0, "a number of seconds >= 0")
_dscp = _checked(int, lambda v: 0 <= v <= 63, "an integer in 0..63")


def _host(text: str) -> str:
    try:
        return str(ipaddress.IPv4Address(text))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(text)
    except OSError:
        raise argparse.ArgumentTypeError(f"must be an IPv4 address or a known host name, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m dlcp.topologies.traffic", description="Cross traffic for testbed runs.")
    sub = p.add_subparsers(dest="role", required=True, metavar="{sink,udp,tcp}")
    s = sub.add_parser("sink", help="count UDP and TCP received on PORT")
    s.add_argument("port", type=_port, metavar="PORT")
    u = sub.add_parser("udp", help="1000-byte datagrams at RATE_PPS during on periods")
    t = sub.add_parser("tcp", help="one connection, as fast as possible during on periods")
    for sp in (u, t):
        sp.add_argument("dst", type=_host, metavar="DST")
        sp.add_argument("port", type=_port, metavar="PORT")
        if sp is u:
            sp.add_argument("rate", type=_rate, metavar="RATE_PPS")
        sp.add_argument("on", type=_seconds, metavar="ON_S")
        sp.add_argument("off", type=_seconds, metavar="OFF_S", help="0: always on")
        sp.add_argument("duration", type=_seconds, metavar="DURATION_S")
        sp.add_argument("--dscp", type=_dscp, default=0, metavar="N",
                        help="IP DSCP of the packets, 0..63 (selects the switches' queue)")
        sp.add_argument("--sport", type=_port, default=0, metavar="PORT",
                        help="send from this source port (default: an ephemeral one), so flow hashing gives the "
                             "flow the same path in every run")
    return p


ROLES: dict[str, Callable[[argparse.Namespace, StopFlag], dict]] = {
    "sink": run_sink, "udp": run_udp, "tcp": run_tcp}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one role until DURATION_S or SIGTERM/SIGINT, print its summary. Exit 0 when stopped
    by a signal or finished cleanly, 1 on an error (port in use, sender never connected)."""
    args = build_parser().parse_args(argv)
    stop = StopFlag()
    stop.install()
    try:
        summary = ROLES[args.role](args, stop)
    except OSError as exc:
        print(f"traffic {args.role}: error: port {args.port}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        return 1
    try:
        print(json.dumps(summary), flush=True)
    except OSError:
        pass
    return 0 if stop.stopped or "error" not in summary else 1


if __name__ == "__main__":
    sys.exit(main())
