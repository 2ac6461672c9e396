"""What the host's network interface says about itself: its name, MTU and link speed.

Why: a DLCP endpoint paces to a line rate and cuts packets to an MTU. A user of the
``torch.distributed`` backend configures neither (gloo asks for neither), so the backend takes
both from the interface that carries its address, as NCCL reads a NIC's speed. Linux only
(``/sys/class/net``); anywhere else, and for interfaces that report no speed (loopback, veth,
most virtual NICs), the caller's fallbacks apply.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

SIOCGIFADDR = 0x8915
SYS_NET = Path("/sys/class/net")


@dataclass(frozen=True)
class Interface:
    """One network interface as the kernel reports it."""

    name: str
    mtu: int | None
    """Its MTU in bytes (None: unknown)."""
    speed_bps: float | None
    """Its link speed in bits per second (None: the interface reports none, as loopback and
    virtual interfaces do)."""

    @property
    def loopback(self) -> bool:
        return self.name == "lo"


def _ipv4_of(name: str) -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(raw[20:24])
    except OSError:
        return None
    finally:
        s.close()


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):  # absent, or "Invalid argument" for a link without a speed
        return None


def interface_for(address: str) -> Interface | None:
    """The interface that holds IPv4 ``address`` (a loopback address: ``lo``); None if none does."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    name = "lo" if ip.is_loopback else next((n for _, n in socket.if_nameindex() if _ipv4_of(n) == address), None)
    if name is None:
        return None
    speed = _read_int(SYS_NET / name / "speed")  # Mb/s; -1 or unreadable without a link speed
    return Interface(name, _read_int(SYS_NET / name / "mtu"), speed * 1e6 if speed and speed > 0 else None)
