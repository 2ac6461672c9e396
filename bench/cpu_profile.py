"""Where a collective's CPU goes: the same ``dist.all_reduce`` loop through
``init_process_group("gloo")`` and ``("dlcp")`` (and the named settings of ``bench/backend.py``),
each run sampled by ``perf record`` over the whole machine (every process and the kernel, the
``cpu-clock`` event at 999 Hz), the samples sorted into categories, in CPU ms per rank and call.

Why: with 4 ranks on this machine's 2 cores both cores stay busy (``bench/backend.py``'s idle
column reads 3 %), so a call's time is the CPU its ranks spend on it, halved; a row's ratio to
gloo is then a ratio of CPU, and the question it raises is which work one backend does that the
other does not. The categories answer it in the terms of the work: the kernel's copies between
user and kernel memory (both backends make the same two per byte sent), the packet tag
(AEGISMAC-128X4; AES-GCM when encrypted), the network stack, Python, the compiled data path's loops, gloo's own sums.

Needs ``perf`` (Debian's ``linux-perf``) and the right to sample the whole machine (root, or
``kernel.perf_event_paranoid`` <= 0); without them it says which is missing and exits 2.

The compiled data path as installed is stripped (nanobind strips Release builds), so its loops
count as one category and its tag (AEGISMAC-128X4, compiled in) counts there too. With its
symbols the path splits into the tag, the sums it adds received packets with, and the rest:
rebuild it with ``pip install --no-deps -e . -C cmake.build-type=RelWithDebInfo`` (the same
``-O3`` code, ``-g`` added and not stripped; the same command without ``-C ...`` restores the
stripped build). The table's notes say which build was sampled.

Run: python bench/cpu_profile.py [--world 4] [--bytes 57000000] [--calls 60] [--rounds 2]
[--schemes gloo dlcp untagged] [--out FILE]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.backend import SETTINGS, WARMUP, _step, _user_env  # noqa: E402  (after the path above)
from dlcp.hostagent.loopback import free_tcp_ports  # noqa: E402
from dlcp.hostagent.tables import Column, Record, Table  # noqa: E402

#: Samples per second and CPU (``perf record -F``).
HZ = 999

def _kernel(*words: str) -> str:
    """A pattern for kernel symbols holding one of ``words`` as a whole part between underscores
    (so "sk" matches sk_page_frag_refill, not finish_task_switch)."""
    return r"\[k\] (?:\S*_)?(?:" + "|".join(words) + r")(?:[_.\d]\S*)?$"


#: Categories in the order an entry ("dso [k] symbol" or "dso [.] symbol") is tried against them:
#: the first whose pattern it matches takes it. Why this order: the tag's and the copies' symbols
#: are exact names; the kernel's families after them, the network stack's first.
CATEGORIES: list[tuple[str, str]] = [
    ("idle", _kernel("pv_native_safe_halt", "default_idle", "acpi_idle", "cpuidle", "poll_idle", "mwait_idle")),
    ("tag (MAC, AES-GCM)", r"IPSec_MB|libcrypto|aes_gcm|gmac|ghash|aegis"
                           r"|::(?:vaes512|vaes256|aesni|portable)::(?:mac_from|init_state)\b"),
    ("kernel copies", _kernel("copy_from_iter", "copy_to_iter", "rep_movs_alternative", "copy_user_generic",
                              "copy_from_user", "copy_to_user", "csum_and_copy_from_iter", "simple_copy_to_iter")),
    ("memcpy (libc)", r"libc\.so\S* +\[\.\] \S*(memmove|memcpy|memset)"),
    ("DLCP sums (compiled)", r"_datapath\.\S* +\[\.\] dlcp::.*\b(?:add|sumsq)_(?:any|avx2|body|bf16|f32|rounded)\w*"),
    ("DLCP compiled path", r"_datapath\."),
    ("gloo / torch", r"libtorch|libc10|libgloo|gloo::"),
    ("Python", r"libpython|python3\.\d+ "),
    ("numpy", r"_multiarray|numpy"),
    ("network stack", _kernel("udp", "udp4", "udpv6", "tcp", "ip", "ip4", "ipv4", "skb", "sock", "net", "netif",
                              "napi", "gro", "gso", "loopback", "inet", "dev", "csum", "sk", "backlog", "softnet")),
    ("scheduling, wake-ups", _kernel("schedule", "finish_task_switch", "raw_spin_unlock_irq",
                                     "raw_spin_unlock_irqrestore", "try_to_wake_up", "ttwu", "enqueue", "dequeue",
                                     "update_curr", "select_task_rq", "psi", "switch_mm", "switch_to", "futex", "ep",
                                     "epoll", "poll", "wake", "pick_next_task")),
    ("memory (pages)", _kernel("page", "pages", "folio", "rmqueue", "pcp", "kmem", "kmalloc", "kfree", "slab")),
    ("system calls", _kernel("syscall", "entry_SYSCALL", "irqentry", "exit_to_user_mode", "fdget", "fput",
                             "check_object_size", "virt_addr_valid", "import_iovec", "copy_msghdr", "sys")),
]


def category(line: str) -> str:
    """The category of one ``perf report --sort dso,sym`` entry ("dso [k] symbol" or "dso [.]
    symbol"): the first of :data:`CATEGORIES` whose pattern it matches, else "other kernel"
    or "other user"."""
    line = line.strip()
    for name, pattern in CATEGORIES:
        if re.search(pattern, line):
            return name
    return "other kernel" if "[k]" in line else "other user"


def shares(report: str) -> dict[str, float]:
    """Each category's share of the samples in a ``perf report --stdio --sort dso,sym`` text."""
    out: dict[str, float] = {}
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(.*)", line)
        if m and not line.lstrip().startswith("#"):
            name = category(m.group(2))
            out[name] = out.get(name, 0.0) + float(m.group(1)) / 100
    return out


def datapath_symbols() -> bool:
    """Whether the compiled data path this interpreter imports keeps its symbols (a
    RelWithDebInfo build, see the module's docstring): then its tag and sums are categories of
    their own."""
    import importlib.util

    spec = importlib.util.find_spec("dlcp.hostagent._datapath")
    if spec is None or spec.origin is None or shutil.which("nm") is None:
        return False
    out = subprocess.run(["nm", "--defined-only", spec.origin], capture_output=True, text=True)
    return out.returncode == 0 and "mac_from" in out.stdout


def missing() -> str | None:
    """Why this machine cannot be sampled here, or None."""
    if shutil.which("perf") is None:
        return "perf is not installed (apt-get install linux-perf)"
    try:
        paranoid = int(Path("/proc/sys/kernel/perf_event_paranoid").read_text())
    except OSError:
        paranoid = 2
    if os.geteuid() != 0 and paranoid > 0:
        return f"sampling every process needs root or kernel.perf_event_paranoid <= 0 (it is {paranoid})"
    return None


def _worker(rank: int, world: int, port: int, scheme: str, nbytes: int, calls: int, ready: Any, go: Any,
            q: Any) -> None:
    """A user's rank: the all_reduce loop, timed between two barriers once the parent samples."""
    _user_env(port, rank, world)
    backend = scheme
    if scheme in SETTINGS:
        os.environ.update(SETTINGS[scheme])
        backend = "dlcp"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend)
    step = _step(f"all_reduce:{nbytes}", "float32", rank)
    for _ in range(WARMUP):
        step()
    dist.barrier()
    if rank == 0:
        ready.set()
        go.wait(60)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    q.put((rank, (time.perf_counter() - t0) / calls))
    dist.barrier()
    dist.destroy_process_group()


def run(scheme: str, world: int, nbytes: int, calls: int) -> dict[str, Any]:
    """One sampled run: ms per call (the slowest rank's mean) and each category's CPU ms per
    rank and call."""
    (port,) = free_tcp_ports(1)
    ctx = mp.get_context("spawn")
    q, ready, go = ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(r, world, port, scheme, nbytes, calls, ready, go, q))
             for r in range(world)]
    for p in procs:
        p.start()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        try:
            if not ready.wait(300):
                raise RuntimeError(f"{scheme}: the ranks did not start")
            perf = subprocess.Popen(["perf", "record", "-a", "-q", "-e", "cpu-clock", "-F", str(HZ), "-o", str(data)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.2)  # (perf is sampling by then)
            t0 = time.monotonic()
            go.set()
            per_call = [q.get(timeout=900) for _ in range(world)]
            window = time.monotonic() - t0
            perf.send_signal(signal.SIGINT)
            perf.wait(60)
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
        report = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,sym", "--stdio",
                                 "--percent-limit", "0"], capture_output=True, text=True, check=True).stdout
    cpus = os.cpu_count() or 1
    scale = window * cpus / calls / world * 1e3  # a share of every CPU over the window -> ms per rank and call
    return {"ms": max(t for _, t in per_call) * 1e3, "window_s": window,
            "cpu": {name: share * scale for name, share in shares(report).items()}}


def table(args: argparse.Namespace) -> Table:
    title = (f"where the CPU goes: all_reduce of {args.bytes / 1e6:g} MB float32, {args.world} processes, "
             f"loopback, {args.rounds} interleaved rounds of {args.calls} calls, perf cpu-clock at {HZ} Hz")
    print(title, flush=True)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.schemes}
    for r in range(args.rounds):
        for scheme in args.schemes:
            out = run(scheme, args.world, args.bytes, args.calls)
            runs[scheme].append(out)
            busy = sum(v for k, v in out["cpu"].items() if k != "idle")
            print(f"   round {r + 1}/{args.rounds} {scheme:<9} {out['ms']:7.1f} ms/call  busy {busy:6.1f} ms "
                  f"per rank and call", flush=True)
    symbols = datapath_symbols()
    names = [n for n, _ in CATEGORIES if n != "idle"] + ["other kernel", "other user"]
    t = Table(title, [Column("category"), *(Column(s, "{:.2f}") for s in args.schemes)],
              notes=["CPU ms per rank and call: each category's share of the samples of every CPU over the timed "
                     "calls (and the barriers around them), divided by calls and ranks; medians over rounds",
                     "busy: every category but idle; ms per call: the slowest rank's mean",
                     "kernel copies: between user and kernel memory; "
                     + ("the compiled path with its symbols: its tag and its sums are rows of their own"
                        if symbols else
                        "the compiled path stripped (as installed): its loops, the tag and the sums, are one row")])

    def med(scheme: str, key: str) -> float:
        return statistics.median(x["cpu"].get(key, 0.0) for x in runs[scheme])
    for name in names:
        t.add(name, *(med(s, name) for s in args.schemes))
    t.add("busy", *(statistics.median(sum(v for k, v in x["cpu"].items() if k != "idle") for x in runs[s])
                    for s in args.schemes))
    t.add("idle", *(med(s, "idle") for s in args.schemes))
    t.add("ms per call", *(statistics.median(x["ms"] for x in runs[s]) for s in args.schemes))
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4, help="processes (default 4)")
    ap.add_argument("--bytes", type=int, default=57_000_000, help="the tensor's bytes (default 57 MB)")
    ap.add_argument("--calls", type=int, default=60, help="timed calls per run (default 60)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument("--schemes", nargs="+", default=["gloo", "dlcp", "untagged"],
                    choices=["gloo", "dlcp", *SETTINGS],
                    help="backends and named settings of bench/backend.py (default gloo dlcp untagged)")
    ap.add_argument("--out", type=Path, default=None, metavar="FILE",
                    help="also keep the table with the command and commit as JSON (dlcp report FILE prints it)")
    args = ap.parse_args()
    why = missing()
    if why is not None:
        print(f"bench/cpu_profile.py: {why}", file=sys.stderr)
        sys.exit(2)
    record = Record.start("python bench/cpu_profile.py")
    print(record.header())
    done = [table(args)]
    print(done[0].text())
    record.keep(args.out, done)


if __name__ == "__main__":
    main()
