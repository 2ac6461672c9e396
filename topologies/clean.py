"""``dlcp clean``: remove what a crashed ``dlcp run`` left behind, and nothing else.

Runs register what they start (process ids, switch namespaces) in ``/tmp/dlcp-runs``. This
kills those processes (if they still run), removes the bottleneck schedulers ``dlcpctl``
installed (root qdiscs with DLCP's handle, :data:`dlcp.controller.scheduler.HANDLE`, in this
namespace and in the ones it deletes), deletes the namespaces, and removes any network
namespace or interface whose name starts with ``dlcp`` (the prefix of everything DLCP
creates). It does not kill processes by name.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from dlcp.controller import scheduler
from dlcp.topologies import bpf_dctcp, netns
from dlcp.topologies.registry import REGISTRY


def clean_namespaces(names: list[str]) -> None:
    for name in names:
        if netns.netns_exists(name):
            netns.del_netns(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def clean(registry: Path | None = None) -> dict[str, int]:
    """Undo leftovers; returns what was removed."""
    registry = registry or REGISTRY
    killed = 0
    schedulers = 0
    for f in sorted(registry.glob("*.json")) if registry.exists() else []:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            data = {}
        for pid in data.get("pids", []):
            if _alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                killed += 1
        for name in data.get("netns", []):
            if netns.netns_exists(name):
                schedulers += len(scheduler.remove(name))
        clean_namespaces(data.get("netns", []))
        if data.get("allowed_cc"):
            netns.restore_allowed_congestion_controls(data["allowed_cc"])
        if data.get("bpf_cc"):
            bpf_dctcp.unregister()
        f.unlink(missing_ok=True)
    schedulers += len(scheduler.remove(None))
    spaces = netns.list_netns()
    for name in spaces:
        schedulers += len(scheduler.remove(name))
    for name in spaces:
        netns.del_netns(name)
    links = netns.list_links()
    for name in links:
        netns.del_link(name)
    return {"processes": killed, "schedulers": schedulers, "namespaces": len(spaces), "links": len(links)}
