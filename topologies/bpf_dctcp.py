"""DCTCP for kernels without it: ``dlcp_dctcp``, a BPF congestion control the testbed registers.

``gloo-dctcp`` is gloo over DCTCP, what a datacenter tunes TCP to when its switches mark ECN
(issue 43's fair baseline). Where the kernel has ``tcp_dctcp`` (built in, or ``modprobe
tcp_dctcp``) the scheme uses it. Where it was built without it (``CONFIG_TCP_CONG_DCTCP`` unset,
as on the machine these pages were measured on), the same algorithm runs as a BPF
``tcp_congestion_ops`` (``topologies/bpf/dlcp_dctcp.bpf.c``, rule for rule Linux's DCTCP), which
any kernel with BPF struct_ops and BTF takes (5.6 and later).

It is compiled once per kernel and source (clang with the BPF target; the kernel's own types from
``/sys/kernel/btf/vmlinux`` through bpftool) into ``~/.cache/dlcp/bpf`` and registered with
``bpftool struct_ops register`` for the run that needs it (root); the run unregisters it at its
end, and ``dlcp clean`` after a crash. Prerequisites: ``apt-get install clang bpftool libbpf-dev``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

#: The congestion control's name, as host namespaces choose it (net.ipv4.tcp_congestion_control).
NAME = "dlcp_dctcp"
SOURCE = Path(__file__).resolve().parent / "bpf" / "dlcp_dctcp.bpf.c"
BTF = Path("/sys/kernel/btf/vmlinux")
AVAILABLE = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")


class BpfUnavailable(RuntimeError):
    """It cannot be built or registered here; the message says what is missing."""


def _clang() -> str | None:
    return next((c for c in ("clang", *(f"clang-{v}" for v in range(20, 13, -1))) if shutil.which(c)), None)


def why_unavailable() -> str | None:
    """None when :func:`register` can work here, else what is missing (for an error or a skip)."""
    missing = [what for what, ok in (
        ("clang (apt-get install clang)", _clang() is not None),
        ("bpftool (apt-get install bpftool)", shutil.which("bpftool") is not None),
        ("libbpf's headers (apt-get install libbpf-dev)", Path("/usr/include/bpf/bpf_helpers.h").exists()),
        (f"the kernel's BTF ({BTF})", BTF.exists()),
        ("root", os.geteuid() == 0)) if not ok]
    return None if not missing else f"the BPF DCTCP needs {', '.join(missing)}"


def registered() -> bool:
    """Whether :data:`NAME` is a congestion control of this kernel now."""
    try:
        return NAME in AVAILABLE.read_text().split()
    except OSError:
        return False


def build() -> Path:
    """The compiled object, built first if this kernel and source have none yet.

    Raises:
        BpfUnavailable: a prerequisite is missing, or the compiler failed (its errors quoted).
    """
    why = why_unavailable()
    if why is not None:
        raise BpfUnavailable(why)
    digest = hashlib.sha256(SOURCE.read_bytes() + platform.release().encode()).hexdigest()[:16]
    out = Path(os.environ.get("DLCP_BPF_CACHE", Path.home() / ".cache" / "dlcp" / "bpf")) / digest
    obj = out / "dlcp_dctcp.bpf.o"
    if obj.exists():
        return obj
    out.mkdir(parents=True, exist_ok=True)
    header = subprocess.run(["bpftool", "btf", "dump", "file", str(BTF), "format", "c"], capture_output=True,
                            text=True)
    if header.returncode != 0:
        raise BpfUnavailable(f"bpftool could not read the kernel's types: {header.stderr.strip()[-400:]}")
    (out / "vmlinux.h").write_text(header.stdout)
    tmp = obj.with_suffix(".tmp")
    cc = subprocess.run([str(_clang()), "-O2", "-g", "-target", "bpf", "-D__TARGET_ARCH_x86", "-I", str(out), "-c",
                         str(SOURCE), "-o", str(tmp)], capture_output=True, text=True)
    if cc.returncode != 0:
        raise BpfUnavailable(f"clang could not compile {SOURCE.name}: {cc.stderr.strip()[-800:]}")
    tmp.replace(obj)  # whole or not at all: a concurrent run never loads half an object
    return obj


def register() -> bool:
    """Make :data:`NAME` a congestion control of this kernel (root). Returns True when this call
    registered it (the caller unregisters it, :func:`unregister`), False when it was already.

    Raises:
        BpfUnavailable: it cannot be built, or the kernel refused it (bpftool's words quoted).
    """
    if registered():
        return False
    obj = build()
    res = subprocess.run(["bpftool", "struct_ops", "register", str(obj)], capture_output=True, text=True)
    if res.returncode != 0 or not registered():
        raise BpfUnavailable(f"the kernel refused the BPF DCTCP: {(res.stderr or res.stdout).strip()[-800:]}")
    return True


def unregister() -> None:
    """Take :data:`NAME` away again (connections that use it keep it until they close)."""
    if registered():
        subprocess.run(["bpftool", "struct_ops", "unregister", "name", NAME], capture_output=True)


__all__ = ["NAME", "BpfUnavailable", "build", "register", "registered", "unregister", "why_unavailable"]
