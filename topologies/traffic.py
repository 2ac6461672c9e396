"""Cross traffic for testbed runs: UDP and TCP senders with an on/off pattern, and sinks.

    python -m topologies.traffic sink PORT
    python -m topologies.traffic udp DST PORT RATE_PPS ON_S OFF_S DURATION_S
    python -m topologies.traffic tcp DST PORT ON_S OFF_S DURATION_S

UDP sends 1000-byte datagrams at RATE_PPS during "on" periods; TCP sends as fast as the
network lets it during "on" periods (one connection, so per-flow ECMP keeps it on one path).
Both stop by themselves after DURATION_S; each prints what it sent as JSON.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time


def sink(port: int) -> None:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind(("0.0.0.0", port))
    t = socket.socket()
    t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind(("0.0.0.0", port))
    t.listen(8)

    def drain_udp() -> None:
        while True:
            u.recv(65536)

    def drain_tcp() -> None:
        while True:
            c, _ = t.accept()
            threading.Thread(target=lambda c=c: [None for _ in iter(lambda: c.recv(65536), b"")], daemon=True).start()

    threading.Thread(target=drain_udp, daemon=True).start()
    drain_tcp()


def _on(start: float, on: float, off: float) -> bool:
    return off <= 0 or (time.monotonic() - start) % (on + off) < on


def udp(dst: str, port: int, rate: float, on: float, off: float, duration: float) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    payload = b"\0" * 1000
    start = time.monotonic()
    sent, next_t = 0, start
    while time.monotonic() - start < duration:
        if _on(start, on, off):
            s.sendto(payload, (dst, port))
            sent += 1
        next_t += 1.0 / rate
        time.sleep(max(0.0, next_t - time.monotonic()))
    print(json.dumps({"proto": "udp", "sent_pkts": sent}))


def tcp(dst: str, port: int, on: float, off: float, duration: float) -> None:
    start = time.monotonic()
    sent = 0
    s = None
    for _ in range(50):
        try:
            s = socket.create_connection((dst, port), timeout=2)
            break
        except OSError:
            time.sleep(0.1)
    if s is None:
        print(json.dumps({"proto": "tcp", "error": "no connection"}))
        return
    s.settimeout(0.2)
    chunk = b"\0" * 16384
    while time.monotonic() - start < duration:
        if _on(start, on, off):
            try:
                sent += s.send(chunk)
            except (socket.timeout, BlockingIOError):
                pass
        else:
            time.sleep(0.01)
    s.close()
    print(json.dumps({"proto": "tcp", "sent_bytes": sent}))


if __name__ == "__main__":
    kind, *a = sys.argv[1:]
    if kind == "sink":
        sink(int(a[0]))
    elif kind == "udp":
        udp(a[0], int(a[1]), float(a[2]), float(a[3]), float(a[4]), float(a[5]))
    else:
        tcp(a[0], int(a[1]), float(a[2]), float(a[3]), float(a[4]))
