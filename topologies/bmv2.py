"""Run one BMv2 ``simple_switch_grpc`` process: start it, wait until it answers, stop it.

Used by the Mininet switch class and by the tests' fixtures, so there is one way to start a
switch. The process runs in a network namespace of its own when one is given (BMv2's Thrift
server binds every address of that namespace), with its P4Runtime server on a Unix socket
or on loopback, and ``--priority-queues 8`` so v1model's ``standard_metadata.priority``
selects a real priority queue. Its output goes to a log file in the run directory; if it does
not come up, the error quotes the log's tail.

Before the switch starts, its ports' segmentation and receive offloads are turned off
(:func:`quiet_offloads`): BMv2 reads each port through libpcap, which sizes its capture ring
for 64 KB frames when an interface has any such offload on, so a veth port's ring held about
32 frames and a burst beyond that was lost before the P4 program saw it, counted nowhere.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping

log = logging.getLogger(__name__)

#: v1model's priority is 3 bits.
PRIORITY_QUEUES = 8


class Bmv2Error(RuntimeError):
    """The switch process could not be started (the message has its log's tail)."""


@dataclass(frozen=True)
class Bmv2Options:
    """How to start one switch."""

    name: str
    device_id: int
    ports: Mapping[int, str]
    """BMv2 port number -> interface name (in the switch's namespace)."""
    grpc: str
    """P4Runtime address: ``unix:/path`` or ``127.0.0.1:port``."""
    thrift_port: int
    log_dir: Path
    netns: str | None = None
    config_json: Path | None = None
    """Load this BMv2 JSON at start; None starts empty (the controller pushes the pipeline)."""
    priority_queues: int = PRIORITY_QUEUES
    log_level: str = "warn"
    extra_args: tuple[str, ...] = field(default=())


def binary() -> str | None:
    """Path of simple_switch_grpc, or None when BMv2 is not installed."""
    return shutil.which("simple_switch_grpc")


def terminate_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM a process started with ``start_new_session=True`` and its whole group; SIGKILL
    what is left after ``grace`` seconds. By process id only, never by name."""
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


#: ``ethtool -k`` names of the offloads that make libpcap expect 64 KB frames.
PCAP_SIZING_OFFLOADS = {"tso": "tcp-segmentation-offload", "gso": "generic-segmentation-offload",
                        "gro": "generic-receive-offload", "lro": "large-receive-offload"}


def _offloads_on(text: str) -> list[str]:
    """The offloads an ``ethtool -k`` listing shows on (fixed or not)."""
    on = []
    for line in text.splitlines():
        name, _, value = line.strip().partition(":")
        if name in PCAP_SIZING_OFFLOADS.values() and value.split()[:1] == ["on"]:
            on.append(name)
    return on


def quiet_offloads(iface: str, netns: str | None = None) -> None:
    """Turn off the offloads of ``iface`` that make libpcap size BMv2's capture ring for 64 KB
    frames (libpcap then holds about 2 MB / 64 KB = 32 frames per port; with them off, about a
    thousand). Raises :class:`Bmv2Error` naming any that stay on."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    if shutil.which("ethtool") is None:
        raise Bmv2Error("ethtool is not installed (Debian package ethtool): it is needed to turn off "
                        f"{iface}'s offloads, without which BMv2 loses bursts of more than ~32 packets")
    args = [a for key in PCAP_SIZING_OFFLOADS for a in (key, "off")]
    # A fixed-off feature makes ethtool complain and exit non-zero; what counts is the state after.
    subprocess.run([*prefix, "ethtool", "-K", iface, *args], capture_output=True)
    shown = subprocess.run([*prefix, "ethtool", "-k", iface], capture_output=True, text=True)
    if shown.returncode != 0:
        raise Bmv2Error(f"ethtool -k {iface}: {shown.stderr.strip() or shown.returncode}")
    still = _offloads_on(shown.stdout)
    if still:
        raise Bmv2Error(f"{iface}: could not turn off {', '.join(still)}; BMv2 would lose bursts of "
                        "more than ~32 packets on it")


class Bmv2Switch:
    """One simple_switch_grpc process."""

    def __init__(self, options: Bmv2Options) -> None:
        self.options = options
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(options.log_dir) / f"{options.name}.log"

    def command(self) -> list[str]:
        o = self.options
        exe = binary()
        if exe is None:
            raise Bmv2Error("simple_switch_grpc is not installed (install BMv2 from p4lang's packages)")
        cmd = [exe, "--device-id", str(o.device_id), "--thrift-port", str(o.thrift_port),
               "--log-file", str(Path(o.log_dir) / f"{o.name}.bmv2"), "--log-level", o.log_level, "--log-flush"]
        for port, iface in sorted(o.ports.items()):
            cmd += ["-i", f"{port}@{iface}"]
        cmd += [str(o.config_json)] if o.config_json else ["--no-p4"]
        cmd += [*o.extra_args, "--", "--grpc-server-addr", o.grpc, "--priority-queues", str(o.priority_queues)]
        if o.netns:
            cmd = ["ip", "netns", "exec", o.netns, *cmd]
        return cmd

    def start(self, timeout: float = 20.0) -> Bmv2Switch:
        """Start the process and wait until its P4Runtime server accepts a connection."""
        import grpc

        Path(self.options.log_dir).mkdir(parents=True, exist_ok=True)
        for iface in self.options.ports.values():
            quiet_offloads(iface, self.options.netns)
        if self.options.grpc.startswith("unix:"):
            sock = Path(self.options.grpc[5:])
            sock.parent.mkdir(parents=True, exist_ok=True)
            sock.unlink(missing_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        channel = grpc.insecure_channel(self.options.grpc)
        ready = grpc.channel_ready_future(channel)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise Bmv2Error(f"switch {self.options.name} exited with code {self.proc.returncode} at start; "
                                    f"log {self.log_path}:\n{tail(self.log_path)}")
                try:
                    ready.result(timeout=0.5)
                    log.info("switch %s up (pid %d, gRPC %s)", self.options.name, self.proc.pid, self.options.grpc)
                    return self
                except grpc.FutureTimeoutError:
                    continue
        finally:
            ready.cancel()
            channel.close()
        self.stop()
        raise Bmv2Error(f"switch {self.options.name}: gRPC {self.options.grpc} did not answer within {timeout:g} s; "
                        f"log {self.log_path}:\n{tail(self.log_path)}")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the process (its whole session), then kill it if it lingers."""
        if self.proc is None:
            return
        terminate_group(self.proc, timeout)
        self.proc = None
        if self.options.grpc.startswith("unix:"):
            Path(self.options.grpc[5:]).unlink(missing_ok=True)
