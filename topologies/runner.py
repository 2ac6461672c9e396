"""``dlcp run``: one command from topology to comparison table.

The sequence, in this order and undone in ``finally`` (also on Ctrl-C or an error):
register the run (for ``dlcp clean``), build and start the Mininet network of BMv2
switches, then per scheme: apply the controller configuration for that scheme, start the
cross traffic, start the agents (parameter server and workers) in their hosts, wait for the
workers, stop the rest, read the switch counters; finally write ``results.json``, the plots
and the summary, and tear everything down.

Schemes (``dlcp.topologies.schemes.SCHEMES``): ``baseline`` (one FIFO queue, per-flow ECMP, reliable transport, no
selective drop), ``dlcp`` (all three mechanisms) and ablations that switch on one mechanism
at a time: ``lb`` (per-packet spraying), ``prio`` (priority queueing), ``drop`` (selective
dropping), ``bounded`` (bounded-loss completion); and what users run instead
(``dlcp.topologies.schemes.GLOO_SCHEMES``): ``gloo`` (stock DDP over gloo), ``gloo-fp16`` and
``powersgd`` (PyTorch's compression hooks), ``gloo-ecn`` and ``gloo-dctcp`` (gloo over TCP that
reacts to the switches' ECN marks: ``GLOO_TCP``), on the baseline's fabric; and the same
stock-DDP script over ``init_process_group("dlcp")``, ``dlcp-backend`` (``BACKEND_SCHEMES``),
as PyTorch users run DLCP, on ``dlcp``'s fabric. A scheme may name its
pattern (``dlcp:ring``); the speedups are against the reference scheme (``gloo`` when it runs,
else ``baseline``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from dlcp.hostagent.auth import new_secret
from dlcp.hostagent.errors import DlcpUserError, UsageError
from dlcp.hostagent.model_profiles import PROFILES
from dlcp.hostagent.policy import ECN_BACKLOGS, MAX_PRIORITIES, PATTERNS, Policy
from dlcp.hostagent.ranges import Range
from dlcp.hostagent.ratecontrol import link_rates
from dlcp.hostagent.transport_config import PORTS_PER_DEST, link_timers
from dlcp.hostagent.wire import IP_UDP_OVERHEAD
from dlcp.topologies import bpf_dctcp, paths, traffic
from dlcp.topologies.bmv2 import terminate_group
from dlcp.topologies.gloo_ports import (Connection, GlooPorts, expected_connections, fixed_ports, namespace_settings,
                                        parse_connections)
from dlcp.topologies.netns import (NetnsError, allow_congestion_control, list_netns,
                                   restore_allowed_congestion_controls, tcp_counters)
from dlcp.topologies.bound import cross_traffic_load, iteration_traffic, line_rate_bound
from dlcp.hostagent.provenance import cpu_probe_ms, provenance
from dlcp.topologies.registry import REGISTRY, Registry, hold_testbed
from dlcp.topologies.options import COMMON_RANGES, WORKLOADS, check_options
from dlcp.topologies.progress import Progress
from dlcp.topologies.results import document
from dlcp.topologies.schemes import (BACKEND_SCHEMES, FP16_SCHEMES, GLOO_SCHEMES, GLOO_TCP, TORCH_SCHEMES,
                                    check_schemes, mechanisms, policy_for, torch_backend_of,
                                     split_label, wire_dtype_of)
from dlcp.topologies.topos import HOST_PORTS, TOPOLOGIES, TopologyDesc, short, with_host_ports
from dlcp.topologies.validity import MeteredPort, RunMonitor, ServiceSampler, judge, losses, machine_busy, outside_busy
from dlcp.topologies.workload import TRAINING_WORKLOADS

log = logging.getLogger(__name__)

PYTHON = sys.executable


@dataclass(frozen=True)
class RunOptions:
    topology: str = "star"
    workers: int = 4
    schemes: tuple[str, ...] = ("baseline", "dlcp")
    iterations: int = 10
    workload: str = "resnet50"
    pattern: str = "ps"
    scale: float = 0.002
    """Multiplies every tensor of the model, so BMv2's tens of kpps can carry an iteration."""
    compute_ms: float = 500.0
    capacity_pps: int = 2000
    """Bottleneck capacity in frames per second, every frame one slot whatever its size; with
    ``capacity_bps``, the full-size frames per second that rate carries (what the hosts' rate
    configuration, the line-rate bound and the cross traffic's rate are computed from)."""
    capacity_bps: int = 0
    """Bottleneck capacity in bits per second on the wire, each frame charged its own bytes (so
    an ACK costs an ACK); 0: ``capacity_pps`` packets per second."""
    buffer: int = 64
    cross_traffic: bool = True
    cross_rate: float = 0.5
    """UDP cross traffic rate as a fraction of the bottleneck capacity."""
    mtu: int = 1500
    loss_bound: float = 0.05
    ecn_backlog: str = Policy.ecn_backlog
    """What switches compare with the ECN threshold (:attr:`dlcp.hostagent.policy.Policy.ecn_backlog`)."""
    fusion: bool = True
    """Pack tensors into DDP-style buckets (caps scaled by ``scale``); off: one message per tensor."""
    repeat: int = 1
    """Runs of every scheme, interleaved (A B A B ...), for confidence intervals."""
    first_repeat: int = 0
    """The first repetition's number: repetitions ``first_repeat`` .. ``first_repeat + repeat - 1``
    train from those seeds and take those repetitions' source ports, so a later run adds new
    repetitions to an earlier one's instead of repeating its seeds (``dlcp report --merge``
    pairs them as one run)."""
    calibration_iterations: int = 3
    """Communication-only iterations after the measured ones, for the ordering efficiency E."""
    cross_priority: int | None = None
    """Switch queue of the cross traffic (its DSCP maps there); None: best effort (queue 0)."""
    strict: bool = False
    """``dlcp run`` exits non-zero when a scheme's run is invalid (see dlcp.topologies.validity)."""
    target_accuracy: float | None = None
    """Training workloads: time-to-accuracy target; None: the reference's final accuracy in the
    same repetition (each trains from its own seed) - 0.5 points (dlcp.topologies.report.tta_targets)."""
    eval_every: int | None = None
    """Training workloads: evaluate every this many iterations; None: iterations // 20 (at least 1)."""
    out: str = "runs"
    quiet: bool = False
    timeout: float = 600.0
    policy: Policy | None = None
    """The base policy (``--policy FILE``): each scheme keeps what of it that scheme turns on
    (:func:`dlcp.topologies.schemes.policy_for`); None: DLCP's defaults, thresholds from ``buffer``."""
    reference: str | None = None
    """The scheme (as given in ``schemes``) speedups and the default accuracy target are taken
    against; None: ``gloo`` when it runs (what users run), else ``baseline``."""
    host_ports: str = "free"
    """The job hosts' own switch ports: ``free`` (only the topology's bottlenecks are limited)
    or ``capped`` (bottlenecks of the same capacity too: a link of the rate DLCP's hosts are
    configured for, for every scheme; :func:`dlcp.topologies.topos.with_host_ports`)."""
    host_tcp: str = "cubic"
    """TCP congestion control of every host (gloo's connections, the TCP cross traffic, DLCP's
    control connections): Linux's default, whatever the machine running the testbed uses
    (a host namespace inherits the machine's, which may be BBR)."""

    @property
    def numbered(self) -> bool:
        """Whether run directories and progress lines name each run's repetition (``-r2``): when
        there are several, or they are numbered from other than 0 (``first_repeat``)."""
        return self.repeat > 1 or self.first_repeat > 0

    def validate(self) -> None:
        """Raises :class:`UsageError` naming the first option out of its range or unknown."""
        if self.topology not in TOPOLOGIES:
            raise UsageError(f"unknown topology {self.topology!r}; one of {sorted(TOPOLOGIES)}")
        try:
            names = [split_label(label, self.pattern)[0] for label in self.schemes]
            check_schemes(tuple(names), (*TORCH_SCHEMES, *FP16_SCHEMES))
        except DlcpUserError as exc:
            raise UsageError(str(exc)) from None
        if len(set(self.schemes)) != len(self.schemes):
            raise UsageError(f"--scheme names a scheme twice: {list(self.schemes)}")
        if self.reference is not None and self.reference not in self.schemes:
            raise UsageError(f"--reference {self.reference!r} is not one of the run's schemes {list(self.schemes)}")
        if "powersgd" in names and self.workload not in TRAINING_WORKLOADS:
            raise UsageError(f"scheme powersgd compresses a real model's gradients: it needs a training workload "
                             f"({', '.join(TRAINING_WORKLOADS)}), not {self.workload!r}")
        for name in set(names) & set(BACKEND_SCHEMES):
            if self.workload not in TRAINING_WORKLOADS:
                raise UsageError(f"scheme {name} runs stock DDP over the dlcp backend, which knows gradients "
                                 "by DDP's backward pass: it needs a training workload "
                                 f"({', '.join(TRAINING_WORKLOADS)}), not {self.workload!r} (synthetic buckets "
                                 "all-reduced outside a backward pass would travel untagged and reliable)")
        check_options(self, RANGES, CHOICES)
        available = tcp_congestion_controls()
        if available is not None and self.host_tcp not in available:
            raise UsageError(f"--host-tcp {self.host_tcp!r}: this kernel has {sorted(available)} "
                             f"(another may load with modprobe tcp_{self.host_tcp})")
        for name in names:
            cc = GLOO_TCP.get(name, {}).get(CC_KEY)
            if cc is None or available is None or cc in available:
                continue
            if cc == "dctcp" and (bpf_dctcp.registered() or bpf_dctcp.why_unavailable() is None):
                continue  # the BPF DCTCP stands in (run registers it)
            why = bpf_dctcp.why_unavailable() if cc == "dctcp" else None
            raise UsageError(f"scheme {name} runs gloo over {cc}, which this kernel does not have "
                             f"(it has {sorted(available)}; modprobe tcp_{cc} may load it"
                             + (f"; {why} to stand in" if why else "") + "); "
                             "gloo-ecn reacts to the same marks with the host's own congestion control")


def gloo_tcp(scheme: str) -> dict[str, str]:
    """The sysctls a gloo scheme sets on its hosts (:data:`GLOO_TCP`), DCTCP being the BPF one
    (:mod:`dlcp.topologies.bpf_dctcp`) where the kernel has no ``dctcp``."""
    settings = dict(GLOO_TCP.get(scheme, {}))
    available = tcp_congestion_controls()
    if settings.get(CC_KEY) == "dctcp" and available is not None and "dctcp" not in available:
        settings[CC_KEY] = bpf_dctcp.NAME
    return settings


def scheme_congestion_controls(opts: RunOptions) -> list[str]:
    """The TCP congestion controls the run's gloo schemes set on their hosts (:func:`gloo_tcp`)."""
    names = [split_label(label, opts.pattern)[0] for label in opts.schemes]
    return [cc for n in names if (cc := gloo_tcp(n).get(CC_KEY))]


def needs_bpf_dctcp(opts: RunOptions) -> bool:
    """Whether a scheme of the run runs over the BPF DCTCP (the kernel has no ``dctcp``)."""
    return bpf_dctcp.NAME in scheme_congestion_controls(opts)


#: The allowed values of every numeric option of a run: checked by :meth:`RunOptions.validate`
#: and by ``dlcp run``'s parser as the options are typed (a field set to None is not checked).
#: What the simulator takes too is :data:`dlcp.topologies.options.COMMON_RANGES`.
RANGES: dict[str, Range] = {
    **COMMON_RANGES,
    "workers": Range(2, 7),
    "capacity_pps": Range(10),
    "cross_rate": Range(0, 1),
    "calibration_iterations": Range(1, 20),
    "cross_priority": Range(0, MAX_PRIORITIES - 1),
    "target_accuracy": Range(0, 1, lo_open=True),
    "eval_every": Range(1),
    "timeout": Range(0, lo_open=True),
    "first_repeat": Range(0, 999),
}


#: The sysctl that chooses a namespace's TCP congestion control.
CC_KEY = "net.ipv4.tcp_congestion_control"


def tcp_congestion_controls() -> set[str] | None:
    """The TCP congestion controls this kernel has loaded (None where it does not say)."""
    try:
        return set(Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split())
    except OSError:
        return None


#: The choice options of a run and their allowed values.
CHOICES: dict[str, tuple[str, ...]] = {"workload": WORKLOADS, "pattern": PATTERNS, "ecn_backlog": ECN_BACKLOGS,
                                     "host_ports": HOST_PORTS}


def reference_scheme(opts: RunOptions) -> str | None:
    """The scheme the run's speedups are against (:attr:`RunOptions.reference`)."""
    if opts.reference is not None:
        return opts.reference
    return next((s for s in ("gloo", "baseline") if s in opts.schemes), None)


def scheme_policy(scheme: str, opts: RunOptions) -> Policy:
    """The policy of one scheme (:func:`dlcp.topologies.schemes.policy_for`) at this run's buffer and
    bound, from the run's base policy (``--policy``) when it has one."""
    return policy_for(scheme, opts.buffer, opts.loss_bound, opts.ecn_backlog, base=opts.policy)


def cross_dscp(policy: Policy, opts: RunOptions) -> int:
    """The DSCP of the cross traffic's packets: best effort (0), or with ``cross_priority`` the
    DSCP that the scheme's switches map to that queue (the policy's DSCP of that priority).
    Without priority queueing every packet shares queue 0 whatever its DSCP."""
    return 0 if opts.cross_priority is None else policy.dscp[opts.cross_priority]


def cross_pairs(topo: TopologyDesc) -> list[tuple]:
    """(source, destination) hosts of the UDP and the TCP cross traffic: into the server's port
    on the star; across the leaves (through the uplinks the workers' pushes use) elsewhere."""
    xs = topo.role("cross")
    if topo.name == "star":
        server = topo.role("server")[0]
        return [(xs[0], server), (xs[1], server)]
    return [(xs[0], xs[1]), (xs[0], xs[1])]


def scheme_bound(topo: TopologyDesc, opts: RunOptions, scheme: str, spec: dict) -> dict | None:
    """The line-rate bound of one scheme (:mod:`dlcp.topologies.bound`); None for real training.

    The capacity left to the gradients is the bottleneck's minus the UDP cross traffic's
    average (rate x 50 % duty) where that traffic shares the gradients' queue: always without
    priority queueing; with it, only when ``cross_priority`` lifts the cross traffic above best
    effort. TCP cross traffic is elastic and not subtracted. Bounded loss lowers the packets a
    message needs to (1 - p) of them. A DLCP host's own link counts at the line rate it paces
    to (a parameter server's answers all leave through it)."""
    if opts.workload not in PROFILES or GLOO_SCHEMES.get(scheme):
        return None  # a compression hook's bytes on the wire are not DLCP's
    traffic = iteration_traffic(spec, topo, bounded=mechanisms(scheme)["bounded"])
    shares = not mechanisms(scheme)["prio"] or bool(opts.cross_priority)
    cross = {}
    if opts.cross_traffic and shares:
        src, dst = cross_pairs(topo)[0]
        cross = cross_traffic_load(topo, src.name, dst.name, opts.capacity_pps * opts.cross_rate, 0.5)
    # DLCP's hosts pace to their configured line rate, a datagram (MTU less IP and UDP) at a
    # time; gloo's send as fast as their TCP and ports let them
    paced = split_label(scheme, opts.pattern)[0] not in TORCH_SCHEMES
    host_pps = spec["rate"]["line_rate"] / (opts.mtu - IP_UDP_OVERHEAD) if paced else 0.0
    b = line_rate_bound(topo, traffic, opts.capacity_pps, cross, host_pps=host_pps)
    return {"seconds": b.seconds, "port": [short(b.port[0]), b.port[1]] if b.port else None, "packets": b.packets,
            "capacity_left_pps": b.capacity_left_pps, "cross_shares_queue": shares}


def capacity_slots(opts: RunOptions) -> float:
    """A bottleneck's capacity in slots (full-size frames) per second, what its scheduler's
    service is measured in (:func:`dlcp.controller.scheduler.charge`)."""
    from dlcp.controller.scheduler import charge

    return opts.capacity_bps / 8 / charge(True, opts.mtu).slot if opts.capacity_bps else float(opts.capacity_pps)


def testbed_rate(capacity_pps: int, mtu: int) -> dict:
    """DLCP's hosts' rate configuration: what a user on a link of the fabric's rate (``capacity_pps``
    full packets of ``mtu`` bytes) would set, :func:`dlcp.hostagent.ratecontrol.link_rates`."""
    return link_rates(capacity_pps * mtu, mtu)


#: The port of gloo's rendezvous store, on worker 0's host (``dlcp.topologies.agent.run_gloo``).
GLOO_STORE_PORT = 29500


#: Source ports of repetition r's flows start at FLOW_PORTS + r * FLOW_PORT_STEP (r modulo
#: FLOW_PORT_DRAWS): below Linux's ephemeral range (32768-60999), so no other socket takes them.
FLOW_PORTS, FLOW_PORT_STEP, FLOW_PORT_DRAWS = 20000, 1024, 12
#: Offsets of the cross traffic's senders and of gloo's two ports (:mod:`dlcp.topologies.gloo_ports`)
#: from a repetition's base (DLCP's data sockets take the first 8 per rank,
#: :func:`dlcp.hostagent.transport_config.source_ports`).
CROSS_UDP_PORT, CROSS_TCP_PORT, GLOO_PORTS = 512, 513, 514
#: Where the cross traffic's sinks listen.
CROSS_SINK_PORT = 5001


def run_order(opts: RunOptions) -> list[tuple[int, str]]:
    """The runs of ``opts`` as (repetition, scheme), in the order they run: every scheme of a
    repetition, then the next (A B A B ...), repetitions numbered from ``first_repeat``. The
    number is the repetition's seed and path draw (:func:`flow_port_base`)."""
    first = opts.first_repeat
    return [(r, scheme) for r in range(first, first + opts.repeat) for scheme in opts.schemes]


def flow_port_base(repeat: int) -> int:
    """The first source port of repetition ``repeat``'s flows: DLCP's data sockets and the
    cross traffic's senders leave from fixed ports, so where switches hash flows onto paths
    (the baseline's per-flow ECMP) every scheme of one repetition takes the same paths and the
    comparison paired by repetition is not a comparison of two draws of collisions; the
    repetitions draw different paths (as the simulator's seeds do). gloo's connections take
    fixed ports too (:func:`gloo_ports`)."""
    return FLOW_PORTS + FLOW_PORT_STEP * (repeat % FLOW_PORT_DRAWS)


def gloo_ports(repeat: int) -> GlooPorts:
    """The two ports gloo's hosts are limited to in repetition ``repeat``
    (:mod:`dlcp.topologies.gloo_ports`)."""
    return GlooPorts(flow_port_base(repeat) + GLOO_PORTS)


def flow_paths(network: dict, spec: dict, policy: Policy, gloo: bool, cross: list[tuple[str, str]],
               repeat: int, gloo_connections: list[Connection] | None = None,
               dlcp_ports: bool = True) -> dict[str, str]:
    """The path of every flow of one run whose path a switch hashes from its 5-tuple
    (:mod:`dlcp.topologies.paths`), as ``{flow: "switch:port switch:port ..."}``: DLCP's data between
    every two ranks at each priority (unless sprayed, ``lb_mode`` other than ``flow``), gloo's
    connections (``gloo_connections`` as read during the run; by default the ones its fixed ports
    make, :func:`gloo_ports`) and the cross traffic's UDP and TCP (``cross``: their source and
    destination addresses). A parameter server's workers send only to the server and back; a
    ring's may send to any other. ``dlcp_ports`` False: DLCP's data leaves from ports the
    backend picks (``dlcp-backend``), so no path of it is computed. Pure: what the run's fixed
    source ports make of its network."""
    base = flow_port_base(repeat)
    ips = spec["peer_ips"]
    names = [f"worker{r}" for r in range(spec["workers"])] + ["server"] * (len(ips) - spec["workers"])
    flows: list[tuple[str, str, str, int, int, int]] = []
    if gloo:
        rank = {ip: r for r, ip in enumerate(ips[:spec["workers"]])}
        conns = gloo_connections if gloo_connections is not None else \
            expected_connections(ips[:spec["workers"]], gloo_ports(repeat))
        flows += [(f"gloo worker{rank[c.src]}>worker{rank[c.dst]}", c.src, c.dst, paths.TCP, c.sport, c.dport)
                  for c in sorted(conns, key=lambda c: (rank[c.src], rank[c.dst]))]
    elif policy.lb_mode == "flow" and dlcp_ports:
        flows += [(f"{names[a]}>{names[b]} q{q}", ips[a], ips[b], paths.UDP, base + PORTS_PER_DEST * b + q,
                   spec["data_port"])
                  for a in range(len(ips)) for b in range(len(ips))
                  if a != b and (spec["pattern"] != "ps" or "server" in (names[a], names[b]))
                  for q in range(policy.top_priority + 1)]
    for (src, dst), (kind, proto, offset) in zip(cross, (("udp", paths.UDP, CROSS_UDP_PORT),
                                                          ("tcp", paths.TCP, CROSS_TCP_PORT))):
        flows.append((f"cross {kind}", src, dst, proto, base + offset, CROSS_SINK_PORT))
    out = {}
    for label, src, dst, proto, sport, dport in flows:
        out[label] = " ".join(f"{short(sw)}:{port}" for sw, port in paths.hops(network, src, dst, proto, sport, dport))
    return out


def agent_spec(opts: RunOptions, policy: Policy, peer_ips: list[str],
               ports: list[tuple[int, int]] | None = None, scheme: str = "dlcp",
               store_port: int = GLOO_STORE_PORT, repeat: int | None = None) -> dict:
    """What every host agent of a run reads (``dlcp.topologies.agent``): peers, policy, workload, rates.

    ``ports`` gives each rank its own (data, control) ports (agents sharing one address, as on
    loopback); by default every host uses DLCP's ports. GSO/GRO stay off: a BMv2 switch reading
    a veth would see a GSO super-packet as one packet. A gloo ``scheme`` runs DDP over
    ``torch.distributed`` instead of DLCP's agents (``transport`` ``torch``, ``backend`` ``gloo``,
    ``hook``), its store at worker 0's address on ``store_port``; ``dlcp-backend`` the same script
    over ``init_process_group("dlcp")`` (``backend`` ``dlcp``). With ``repeat``, DLCP's data
    leaves from that repetition's fixed source ports (:func:`flow_port_base`) and training
    starts from that repetition's seed (the model's initial weights and every worker's batches,
    :class:`dlcp.topologies.training.Training`): schemes of one repetition share both,
    repetitions differ.
    """
    spec = {"workers": opts.workers, "pattern": opts.pattern, "peer_ips": peer_ips, "data_port": 17649,
            "control_port": 17650, "policy": policy.to_dict(), "mtu": opts.mtu, "model": opts.workload,
            "scale": opts.scale, "iterations": opts.iterations, "compute_ms": opts.compute_ms,
            "deadline": 60.0, "rate": testbed_rate(opts.capacity_pps, opts.mtu), "fusion": opts.fusion,
            "timers": link_timers(opts.capacity_pps * opts.mtu, opts.mtu),
            "bucket_floor_packets": 8, "offload": False, "calibration_iterations": opts.calibration_iterations,
            "secret": new_secret(),  # a fresh job secret per run: control connections must prove it
            "transport": "torch" if scheme in TORCH_SCHEMES else "dlcp", "backend": torch_backend_of(scheme),
            "hook": GLOO_SCHEMES.get(scheme),
            "wire_dtype": wire_dtype_of(scheme), "store_port": store_port}
    if opts.workload in TRAINING_WORKLOADS:
        spec["eval_every"] = opts.eval_every or max(1, opts.iterations // 20)
    if ports is not None:
        spec["ports"] = [list(p) for p in ports]
    if repeat is not None:
        spec["source_port_base"] = flow_port_base(repeat)
        spec["seed"] = repeat
    return spec


def _progress(opts: RunOptions, text: str, final: bool = False) -> None:
    """A progress line rewritten in place on a terminal; elsewhere (a log, CI) only the lines
    marked ``final`` (one per scheme), so a log does not fill with carriage returns."""
    if opts.quiet:
        return
    if sys.stderr.isatty():  # a final line stays; the others are rewritten in place
        print(f"\r\033[K{text}", end="\n" if final and text else "", file=sys.stderr, flush=True)
    elif final and text:
        print(text, file=sys.stderr, flush=True)


def _popen_in(host, args: list[str], log_path: Path) -> subprocess.Popen:
    """Start ``args`` inside a Mininet host's namespace, in a session of its own."""
    out = open(log_path, "ab")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.Popen(["mnexec", "-a", str(host.pid), *args], stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)


class LineCounter:
    """Lines written so far to a file that only grows, reading each byte once.

    Why: the progress line counted the workers' records by reading every file whole twice a
    second; with a message trace per record that was megabytes per read by the end of a long
    run, about 7 % of a core in the runner (py-spy, late in a 1,500-iteration run), which the
    validity rules count against the run."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.lines = path, 0, 0

    def count(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.lines
        self.offset += len(chunk)
        self.lines += chunk.count(b"\n")
        return self.lines


def _reap(monitor: RunMonitor, procs: dict[str, subprocess.Popen]) -> bool:
    """Reap the processes that have exited, each read by ``monitor`` first (a zombie still has
    its CPU times, a reaped process has not); True while any still runs."""
    running = False
    for label, p in procs.items():
        if p.returncode is not None:
            continue
        try:
            exited = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # already reaped elsewhere
            exited = True
        if exited:
            monitor.read(label)
        if p.poll() is None:
            running = True
    return running


def _run_scheme(net, topo: TopologyDesc, opts: RunOptions, label: str, run_dir: Path, registry: Registry,
                index: int, repeat: int, sock_dir: Path) -> dict:
    """One run of the scheme ``label`` names (``dlcp``, ``dlcp:ring``, ``gloo``): its switch
    configuration, then its agents (:func:`_measure_scheme`)."""
    from dlcp.controller import pipeline
    from dlcp.controller.apply import apply_network
    from dlcp.controller.network import parse_network
    from dlcp.controller.p4info import P4Schema
    from dlcp.controller.p4rt import Pipeline
    from dlcp.controller.switch import Switch

    scheme, pattern = split_label(label, opts.pattern)
    opts = replace(opts, pattern=pattern)
    name = label.replace(":", "-")
    sdir = run_dir / (f"{name}-r{repeat + 1}" if opts.numbered else name)
    sdir.mkdir(parents=True, exist_ok=True)
    policy = scheme_policy(scheme, opts)
    # With priority queueing, the agents' control connections (TCP, top priority's DSCP) get
    # the top queue; without it, everything shares queue 0.
    dscp = {policy.dscp[q]: policy.priority_map[q] for q in range(policy.num_priorities)} \
        if mechanisms(scheme)["prio"] else None
    netfile = topo.network(str(sock_dir), opts.capacity_pps, opts.buffer, policy.to_dict(), dscp, opts.capacity_bps)
    (sdir / "network.json").write_text(json.dumps(netfile, indent=2))
    network = parse_network(netfile, f"{scheme} network")
    apply_network(network)
    schema, pipe = P4Schema.load(pipeline.P4INFO), Pipeline.load(pipeline.P4INFO, pipeline.BMV2_JSON)
    with ExitStack() as stack:
        switches = {spec.name: stack.enter_context(Switch(spec, schema, pipe)) for spec in network.switches.values()}
        progress = f"[{index + 1}/{len(opts.schemes) * opts.repeat} {label}" + (
            f" r{repeat + 1}]" if opts.numbered else "]")
        speed = cpu_probe_ms()  # (switches configured, no agent yet: the machine's own speed)
        out = _measure_scheme(net, topo, opts, scheme, policy, sdir, registry, progress, switches, repeat)
    seed = {"seed": repeat} if opts.workload in TRAINING_WORKLOADS else {}  # agent_spec's training seed
    return {**out, "scheme": label, "base_scheme": scheme, "pattern": pattern, "repeat": repeat, **seed,
            "cpu_probe_ms": speed}


def _measure_scheme(net, topo: TopologyDesc, opts: RunOptions, scheme: str, policy: Policy, sdir: Path,
                    registry: Registry, label: str, switches: dict, repeat: int = 0) -> dict:
    """Run the agents (and cross traffic) of one scheme while the monitor samples; read results."""
    def counters() -> dict:
        # the kernel's count first: a frame still in a capture ring then counts in both
        frames = {s.name: s.port_rx_frames() for s in net.switches}
        return {name: {**sw.counters(), "port_rx_frames": frames.get(name, {})} for name, sw in switches.items()}

    bottlenecks = sorted(topo.bottlenecks)
    # every bottleneck's service while backlogged, from its scheduler (the HTB tree on its interface)
    metered = {(short(sw), port): MeteredPort(switches[sw].spec.netns, switches[sw].spec.ports[port].interface,
                                              switches[sw].spec.ports[port].charge, capacity_slots(opts))
               for sw, port in bottlenecks}
    sampler = ServiceSampler(metered).start()
    monitor = RunMonitor({f"switch:{short(s.name)}": s.bmv2.pid for s in net.switches if s.bmv2 and s.bmv2.pid},
                         sampler.totals).start()
    before, tcp_before, sched_before = counters(), _host_tcp(net), sampler.counts()
    workers = topo.role("worker")
    server = topo.role("server")[0]
    peers = [h.ip for h in workers] + ([server.ip] if opts.pattern == "ps" else [])
    spec = agent_spec(opts, policy, peers, scheme=scheme, repeat=repeat)
    (sdir / "agent.json").write_text(json.dumps(spec, indent=2))
    (sdir / "agent.json").chmod(0o600)  # it holds the job secret
    bound = scheme_bound(topo, opts, scheme, spec)
    procs: list[subprocess.Popen] = []
    cross: list[subprocess.Popen] = []
    gloo = scheme in GLOO_SCHEMES
    observed: list[Connection] | None = None  # gloo's connections, read until all are up
    held = ExitStack()  # gloo's fixed ports, given back once its agents are gone
    try:
        if gloo:
            hosts = [net.get(w.name) for w in workers]
            held.enter_context(fixed_ports(hosts, gloo_ports(repeat)))
            held.enter_context(namespace_settings(hosts, gloo_tcp(scheme), f"scheme {scheme}'s TCP"))
        host_cc = _host_cc(net)  # what the run's TCP ran (a gloo scheme's own, set just above)
        if opts.cross_traffic:
            pairs = cross_pairs(topo)
            dsts = {d.name for _, d in pairs}
            for d in dsts:
                sink_cmd = [PYTHON, "-m", "dlcp.topologies.traffic", "sink", str(CROSS_SINK_PORT)]
                cross.append(_popen_in(net.get(d), sink_cmd, sdir / f"sink-{short(d)}.log"))
            time.sleep(0.5)
            duration = str(opts.timeout)
            rate = str(opts.capacity_pps * opts.cross_rate)
            (src, dst), (src2, dst2) = pairs
            tos = ["--dscp", str(cross_dscp(policy, opts))]
            base, sink = flow_port_base(repeat), str(CROSS_SINK_PORT)
            udp = ["udp", dst.ip, sink, rate, "0.5", "0.5", duration, *tos, "--sport", str(base + CROSS_UDP_PORT)]
            tcp = ["tcp", dst2.ip, sink, "0.5", "0.5", duration, *tos, "--sport", str(base + CROSS_TCP_PORT)]
            cross.append(_popen_in(net.get(src.name), [PYTHON, "-m", "dlcp.topologies.traffic", *udp],
                                   sdir / "cross-udp.log"))
            cross.append(_popen_in(net.get(src2.name), [PYTHON, "-m", "dlcp.topologies.traffic", *tcp],
                                   sdir / "cross-tcp.log"))
        for c, name in zip(cross, [f"sink:{short(d)}" for d in sorted(dsts)] + ["cross-udp", "cross-tcp"]
                            if opts.cross_traffic else []):
            monitor.add(name, c.pid)
        if opts.pattern == "ps":
            server_cmd = [PYTHON, "-m", "dlcp.topologies.agent", str(sdir / "agent.json"), str(len(workers)),
                          str(sdir / "server.jsonl")]
            procs.append(_popen_in(net.get(server.name), server_cmd, sdir / "server.log"))
            monitor.add("server", procs[-1].pid)
        outs = []
        for rank, w in enumerate(workers):
            out = sdir / f"worker{rank}.jsonl"
            outs.append(out)
            procs.append(_popen_in(net.get(w.name), [PYTHON, "-m", "dlcp.topologies.agent", str(sdir / "agent.json"),
                                                     str(rank), str(out)], sdir / f"worker{rank}.log"))
            monitor.add(f"worker{rank}", procs[-1].pid)
        registry.pids += [p.pid for p in procs + cross]
        registry.save()
        worker_procs = procs[1:] if opts.pattern == "ps" else procs
        record_counts = [LineCounter(o) for o in outs]
        t0 = time.monotonic()
        while _reap(monitor, {f"worker{rank}": p for rank, p in enumerate(worker_procs)}):
            if time.monotonic() - t0 > opts.timeout:
                raise DlcpUserError(f"scheme {scheme}: workers did not finish within {opts.timeout:g} s (--timeout) "
                                    f"(logs in {sdir})")
            # warm-up + measured + calibration (synthetic) or final (training)
            last = 1 if opts.workload in TRAINING_WORKLOADS else opts.calibration_iterations
            total = (opts.iterations + 1 + last) * len(workers)
            done = min(sum(c.count() for c in record_counts), total)
            if gloo and (observed is None or len(observed) < len(workers) * (len(workers) - 1)):
                observed = _gloo_connections(net, workers)  # the mesh forms as the group starts
            _progress(opts, f"{label} {time.monotonic() - t0:5.0f} s  iterations {done}/{total} "
                      + "#" * int(30 * done / total))
            time.sleep(0.5)
        _progress(opts, f"{label} done in {time.monotonic() - t0:.0f} s")
        failed = [i for i, p in enumerate(worker_procs) if p.returncode != 0]
        if failed:
            raise DlcpUserError(f"scheme {scheme}: worker(s) {failed} failed; see {sdir}/worker{failed[0]}.log")
    finally:
        samples = monitor.stop()
        sampler.stop()
        # agents, then the cross senders, then their sinks (a sink gone first would count the
        # senders' last packets as lost)
        try:
            for p in procs + cross[::-1]:
                terminate_group(p, 3.0)
        finally:
            held.close()
    after, tcp_after, sched_after = counters(), _host_tcp(net), sampler.counts()
    sent = [x for f in sorted(sdir.glob("cross-*.log")) for x in traffic.read_summaries(f)]
    received = [x for f in sorted(sdir.glob("sink-*.log")) for x in traffic.read_summaries(f)]
    records = [json.loads(line) for o in sorted(sdir.glob("worker*.jsonl")) for line in o.read_text().splitlines()]
    server_out = sdir / "server.jsonl"  # the server's totals (endpoints), written as it stops
    if server_out.exists():
        records += [json.loads(line) for line in server_out.read_text().splitlines()]
    iterations = [r for r in records if r.get("kind") != "endpoint"]
    return {"scheme": scheme, "policy": policy.to_dict(), "iterations": iterations,
            "endpoints": {r["rank"]: r["stats"] for r in records if r.get("kind") == "endpoint"},
            "switches": _counter_delta(before, after),
            "validity": _validity(samples, iterations, bottlenecks, opts, len(topo.role("worker")),
                                  {**_silent_losses(before, after), "scheduler": _scheduler_losses(sched_before,
                                                                                                   sched_after)},
                                  monitor.lives),
            "cpu_trace": _cpu_trace(samples), "bound": bound,
            "cross": traffic.summarise(sent, received) if opts.cross_traffic else None,
            "tcp_counters": _tcp_delta(tcp_before, tcp_after), "host_congestion_control": host_cc,
            "flow_port_base": flow_port_base(repeat),
            **(_gloo_record(observed, [w.ip for w in workers], repeat) if gloo else {}),
            "paths": flow_paths(json.loads((sdir / "network.json").read_text()), spec, policy, gloo,
                                [(s.ip, d.ip) for s, d in cross_pairs(topo)] if opts.cross_traffic else [], repeat,
                                observed, dlcp_ports=scheme not in BACKEND_SCHEMES)}


def _gloo_connections(net, workers) -> list[Connection]:
    """gloo's connections between the workers, as their namespaces list them (the store's left out)."""
    ips = {w.ip for w in workers}
    return [c for w in workers for c in parse_connections(net.get(w.name).cmd("ss -tnH state established"))
            if c.src in ips and c.dst in ips and GLOO_STORE_PORT not in (c.sport, c.dport)]


def _gloo_record(observed: list[Connection] | None, ips: list[str], repeat: int) -> dict:
    """What a gloo run records of its ports: the connections read during the run, and whether they
    are the ones the fixed ports make (:func:`gloo_ports`), so its paths are paired by repetition."""
    expected = expected_connections(ips, gloo_ports(repeat))
    key = lambda c: (c.src, c.dst, c.sport, c.dport)  # noqa: E731
    return {"gloo_connections": None if observed is None else [asdict(c) for c in sorted(observed, key=key)],
            "gloo_ports_fixed": None if observed is None else sorted(observed, key=key) == sorted(expected, key=key)}


def _host_tcp(net) -> dict[str, dict[str, int] | None]:
    """Every host's TCP counters (:func:`dlcp.topologies.netns.tcp_counters`): over a run, the
    difference tells which hosts' connections (gloo's, DLCP's control, the cross traffic) lost
    segments and waited out retransmission timeouts."""
    return {short(h.name): tcp_counters(h.pid) for h in net.hosts if getattr(h, "pid", None)}


def _host_cc(net) -> dict[str, str]:
    """Every host's TCP congestion control as the run ends (what gloo and the cross traffic ran)."""
    from dlcp.topologies.net import congestion_control

    return {short(h.name): congestion_control(h) for h in net.hosts}


def _tcp_delta(before: dict, after: dict) -> dict[str, dict[str, int] | None]:
    """Per host, what its counters grew by over the run; None where either reading failed."""
    return {h: None if c is None or before.get(h) is None else {k: v - before[h][k] for k, v in c.items()}
            for h, c in after.items()}


def _silent_losses(before: dict, after: dict) -> dict:
    """Per place and switch port, (packets, packets lost there without a drop counter) over the
    run: frames the interface received against those the pipeline took in; packets the
    pipeline admitted to a port against those that left it."""
    def delta(key: str) -> dict:
        return {(short(sw), int(port)): n - before.get(sw, {}).get(key, {}).get(port, 0)
                for sw, a in after.items() for port, n in a.get(key, {}).items()}

    def per_port(rows_of: dict, name: str) -> dict:
        out: dict = {}
        for sw, c in rows_of.items():
            for r in c["ports"]:
                out[(short(sw), r["port"])] = out.get((short(sw), r["port"]), 0) + r.get(f"{name}_pkts", 0)
        return out

    def port_delta(name: str) -> dict:
        a, b = per_port(after, name), per_port(before, name)
        return {k: v - b.get(k, 0) for k, v in a.items()}

    return {"ingress": losses(delta("port_rx_frames"), delta("received")),
            "buffer": losses(port_delta("admitted"), port_delta("forwarded"))}


def _scheduler_losses(before: dict, after: dict) -> dict:
    """Per bottleneck port, (frames into its scheduler, frames it dropped) over the run, from
    its cumulative (sent, dropped) counts."""
    out = {}
    for port, (sent, dropped) in after.items():
        s0, d0 = before.get(port, (0, 0))
        out[port] = (sent - s0 + dropped - d0, dropped - d0)
    return out


def _validity(samples: list, iterations: list[dict], bottlenecks: list, opts: RunOptions, workers: int,
              silent: dict | None = None, lives: dict | None = None) -> dict:
    """The verdict over the measured iterations (from the first one's start to the last one's end)."""
    measured = [r for r in iterations if r.get("kind") == "measured" and "t_start" in r]
    if not measured:
        return {"valid": False, "reasons": ["no measured iteration with timestamps"]}
    agents = [f"worker{r}" for r in range(workers)] + (["server"] if opts.pattern == "ps" else [])
    capacity = {(short(sw), port): capacity_slots(opts) for sw, port in bottlenecks}
    return judge(samples, min(r["t_start"] for r in measured), max(r["t_end"] for r in measured), capacity,
                 agents, silent=silent, lives=lives).as_dict()


def _cpu_trace(samples: list) -> dict:
    """The machine's CPU use over the scheme's run (for the report's plot), % of all cores, and
    the part of it no process of the run used (:func:`dlcp.topologies.validity.outside_busy`)."""
    busy = machine_busy(samples)
    return {"t": [round(s.t - samples[0].t, 2) for s in samples[1:]] if samples else [],
            "machine_busy": [round(float(b), 1) for b in busy],
            "outside_busy": [round(float(b), 1) for b in outside_busy(samples)]}


def _counter_delta(before: dict, after: dict) -> dict:
    out = {}
    for sw, a in after.items():
        b = before.get(sw, {"ports": [], "drop_reasons": {}, "selective_drops_by_class": {}})
        bp = {(r["port"], r["queue"]): r for r in b["ports"]}
        rows = []
        for r in a["ports"]:
            prev = bp.get((r["port"], r["queue"]), {})
            d = {k: v - prev.get(k, 0) if isinstance(v, int) and k not in ("port", "queue") else v
                 for k, v in r.items()}
            if any(v for k, v in d.items() if k.endswith("_pkts")):
                rows.append(d)
        cls = {c: n - b["selective_drops_by_class"].get(c, 0) for c, n in a["selective_drops_by_class"].items()}
        reasons = {k: v - b["drop_reasons"].get(k, 0) for k, v in a["drop_reasons"].items()}
        out[short(sw)] = {"ports": rows, "drop_reasons": {k: v for k, v in reasons.items() if v},
                          "selective_drops_by_class": {c: n for c, n in cls.items() if n}}
    return out


def run(opts: RunOptions) -> tuple[Path, dict]:
    """Run every scheme on one network; returns the run directory and the results."""
    opts.validate()
    tnet = testbed_ready()
    with hold_testbed():
        return _run_locked(opts, tnet)


def testbed_ready():
    """The Mininet network module, once root, BMv2 and Mininet are there (what every run needs,
    checked before the testbed is taken, so that a sweep fails as clearly as a run).

    Raises:
        DlcpUserError: not root, or BMv2 or Mininet missing."""
    if os.geteuid() != 0:
        raise DlcpUserError("dlcp run needs root (Mininet creates namespaces and links): use sudo")
    from dlcp.topologies import bmv2

    if bmv2.binary() is None:
        raise DlcpUserError("simple_switch_grpc is not installed (BMv2 from p4lang's packages)")
    try:
        from dlcp.topologies import net as tnet
    except ImportError as exc:
        raise DlcpUserError(f"Mininet is not importable ({exc}); install it (Debian: apt-get install mininet) "
                            "and run make setup again") from None
    return tnet


def refuse_a_taken_testbed(topo: TopologyDesc) -> None:
    """Raise before anything is created when a switch namespace of ``topo`` exists already.

    Why, beside the lock: the lock lives in the run registry's directory, which a second run with
    another ``DLCP_RUN_REGISTRY`` or in another mount namespace (a container, a CI job on the same
    kernel) does not share, while the namespace names are the kernel's. Such a run failed
    half-way, and its teardown deleted the live run's namespaces by name, killing that run too.

    Raises:
        DlcpUserError: naming the namespaces found."""
    taken = sorted(set(list_netns()) & {s.name for s in topo.switches})
    if taken:
        raise DlcpUserError(f"network namespace{'s' if len(taken) > 1 else ''} {', '.join(taken)} exist"
                            f"{'' if len(taken) > 1 else 's'} already: another dlcp run is using the testbed (perhaps "
                            "from another container or run registry), or one that died left them; wait for it, or "
                            "stop it and run `dlcp clean`")


def _run_locked(opts: RunOptions, tnet) -> tuple[Path, dict]:
    """:func:`run` once it holds the testbed."""
    topo = with_host_ports(TOPOLOGIES[opts.topology](opts.workers), opts.host_ports)
    refuse_a_taken_testbed(topo)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(opts.out).resolve() / f"{stamp}-{opts.topology}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(asdict(opts), indent=2))
    registry = Registry(REGISTRY / f"{stamp}-{os.getpid()}.json", netns=[s.name for s in topo.switches])
    registry.save()
    sock_dir = Path(tempfile.mkdtemp(prefix="dlcp-"))  # short: a Unix socket path has at most 107 bytes
    net = tnet.build(topo, run_dir, sock_dir)
    results = document("testbed", asdict(opts), [], provenance=provenance(stamp), reference=reference_scheme(opts),
                       topology=topo.name)
    try:
        _progress(opts, "starting switches ...")
        if needs_bpf_dctcp(opts):  # gloo-dctcp on a kernel without DCTCP
            try:
                registry.bpf_cc = bpf_dctcp.register()
            except bpf_dctcp.BpfUnavailable as exc:
                raise DlcpUserError(f"gloo-dctcp: {exc}") from None
            registry.save()
        try:  # else every host namespace silently keeps the machine's default
            registry.allowed_cc = allow_congestion_control(opts.host_tcp, *scheme_congestion_controls(opts))
        except NetnsError as exc:
            raise DlcpUserError(f"--host-tcp {opts.host_tcp}: {exc}") from None
        registry.save()
        tnet.start(net, host_tcp=opts.host_tcp)
        registry.pids += [n.pid for n in net.hosts + net.switches] + [s.bmv2.pid for s in net.switches if s.bmv2]
        registry.save()
        runs = run_order(opts)
        progress = Progress(len(runs), stream=None)
        for i, (r, scheme) in enumerate(runs):
            results["runs"].append(_run_scheme(net, topo, opts, scheme, run_dir, registry, i, r, sock_dir))
            _progress(opts, progress.step(scheme + (f" r{r + 1}" if opts.numbered else "")), final=True)
            if i + 1 < len(runs) and runs[i + 1][0] != r:  # a repetition finished: kept, whatever comes
                from dlcp.topologies.report import keep_partial

                keep_partial(run_dir, results, r + 1 - opts.first_repeat, opts.repeat)
    finally:
        _progress(opts, "tearing down ...")
        try:
            net.stop()
        finally:
            from dlcp.topologies.clean import clean_namespaces

            clean_namespaces(registry.netns)
            restore_allowed_congestion_controls(registry.allowed_cc)
            if registry.bpf_cc:
                bpf_dctcp.unregister()
            registry.remove()
            shutil.rmtree(sock_dir, ignore_errors=True)
            _progress(opts, "")
    from dlcp.topologies.report import finish

    finish(run_dir, results)
    return run_dir, results
