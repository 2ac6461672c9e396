"""A simulated experiment as data, and the scenario file the C++ simulator reads.

Pure: options and a scheme in, text out. Every policy fact comes from the same places the
testbed reads: the scheme's :class:`~dlcp.hostagent.policy.Policy` (:mod:`dlcp.topologies.schemes`), the
worker's buckets (:func:`dlcp.topologies.workload.worker_plan`: the model profile, fusion, layer
priorities), per-packet priorities of fused buckets (:func:`dlcp.hostagent.policy.packet_tags`) and
drop classes from the magnitudes of synthetic gradients drawn as the testbed agent draws them
(:func:`dlcp.hostagent.policy.payload_drop_classes`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from dlcp_sim.background import BackgroundFlow, generate
from dlcp.controller.scheduler import ETH_HEADER, MIN_WIRE_FRAME, WIRE_OVERHEAD
from dlcp.hostagent.errors import DlcpUserError, UsageError
from dlcp.hostagent.fusion import Bucket, Layout
from dlcp.hostagent.packetizer import elems_per_packet
from dlcp.hostagent.protocol.incoming import ANSWER_GAPS, MAX_ANSWER_GRACE
from dlcp.hostagent.policy import ECN_BACKLOGS, PATTERNS, Policy, payload_drop_classes
from dlcp.hostagent.ranges import Range
from dlcp.hostagent.ratecontrol import (CUT_HOLD_ANSWERS, CUT_HOLD_MIN_REPORTS, INITIAL_ALPHA, RateConfig,
                                        link_rates)
from dlcp.hostagent.transport_config import TransportConfig, link_timers
from dlcp.hostagent.wire import HEADER_SIZE, IP_UDP_OVERHEAD, LAST_PACKETS
from dlcp.topologies.bound import host_loads, job_traffic, port_loads
from dlcp.topologies.options import COMMON_RANGES, SYNTHETIC_WORKLOADS, check_options
from dlcp.topologies.schemes import check_schemes, policy_for
from dlcp.topologies.topos import HostDesc, LinkDesc, SwitchDesc, TopologyDesc
from dlcp.topologies.workload import worker_plan

#: TCP variants of the background flows and of the ``tcp`` scheme (ns-3's TcpDctcp, TcpCubic,
#: TcpNewReno).
TCP_VARIANTS = ("dctcp", "cubic", "newreno")
#: The hosts' rate-control loops (:attr:`SimOptions.host_model`).
HOST_MODELS = ("dctcp", "agent")
#: How jobs take hosts (:attr:`SimOptions.jobs_placement`).
JOB_PLACEMENTS = ("spread", "packed")
#: The allowed values of every numeric option of the simulator: checked by
#: :class:`SimOptions` and by ``dlcp sim``'s parser as the options are typed. What the testbed
#: takes too is :data:`dlcp.topologies.options.COMMON_RANGES`.
RANGES: dict[str, Range] = {
    **{k: v for k, v in COMMON_RANGES.items() if k != "repeat"},  # repeat: seeds, an argument of run()
    "leaves": Range(1, 250),  # addresses 10.leaf.host.2
    "spines": Range(1, 250),
    "hosts_per_leaf": Range(1, 250),
    "link_gbps": Range(0, lo_open=True),
    "uplink_gbps": Range(0),  # 0: as link_gbps
    "host_rate_gbps": Range(0),  # 0: as link_gbps
    "link_delay_us": Range(0),
    "workers": Range(1),
    "jobs": Range(0),  # 0: as many as fit
    "warmup": Range(0),
    "background_load": Range(0, 1, hi_open=True),
    "background_ms": Range(0),
    "control_bytes": Range(0),
    "host_delay_us": Range(0),
    "tcp_min_rto_us": Range(1),
    "tcp_ack_every": Range(1, 16),
    "seed": Range(0),
}

#: Simulator-only schemes and the testbed scheme whose fabric they run on: ``tcp`` sends the
#: baseline's messages over one TCP connection per pair of hosts with ``--gradient-tcp``'s
#: congestion control, as gloo, NCCL's socket transport and BytePS do, through the baseline's FIFO
#: ports and per-flow ECMP (dlcp_sim/ns3/tcp-host.h); ``tcp-<variant>`` names the variant, so one
#: run (one set of seeds) compares several.
SIM_ONLY_SCHEMES = {"tcp": "baseline", **{f"tcp-{v}": "baseline" for v in TCP_VARIANTS}}

#: The choice options of the simulator and their allowed values (the workload and pattern are
#: the testbed's: :mod:`dlcp.topologies.options`).
CHOICES: dict[str, tuple[str, ...]] = {
    "workload": SYNTHETIC_WORKLOADS, "pattern": PATTERNS, "ecn_backlog": ECN_BACKLOGS,
    "jobs_placement": JOB_PLACEMENTS, "host_model": HOST_MODELS, "background_tcp": TCP_VARIANTS,
    "gradient_tcp": TCP_VARIANTS,
}


def gradient_tcp(scheme: str, opts: SimOptions) -> str:
    """The congestion control a TCP scheme's gradients use: its own variant, or ``--gradient-tcp``."""
    return scheme[len("tcp-"):] if scheme.startswith("tcp-") else opts.gradient_tcp


def sim_policy(scheme: str, opts: SimOptions) -> Policy:
    """The switch and loss policy of a simulated scheme (:func:`dlcp.topologies.schemes.policy_for`;
    a simulator-only scheme takes its testbed counterpart's)."""
    return policy_for(SIM_ONLY_SCHEMES.get(scheme, scheme), opts.buffer, opts.loss_bound, opts.ecn_backlog)


@dataclass(frozen=True)
class SimOptions:
    """One ``dlcp sim`` experiment: a leaf-spine, its jobs, the workload and the schemes."""

    leaves: int = 2
    spines: int = 2
    hosts_per_leaf: int = 4
    link_gbps: float = 10.0
    """Host links' rate."""
    uplink_gbps: float = 0.0
    """Leaf-spine links' rate; 0: as ``link_gbps`` (then 16 hosts over 4 spines are 4:1
    oversubscribed; pFabric's and DLCP's 144-host fabric has 10 Gb/s hosts and 40 Gb/s uplinks)."""
    link_delay_us: float = 1.0
    buffer: int = 100
    """Packets a switch port holds ahead of a packet before it tail-drops it (per port, as the
    testbed's virtual queue)."""
    pattern: str = "ps"
    """``ps`` (each job has one parameter server besides its workers) or ``ring`` (allreduce)."""
    workers: int = 4
    """Workers per job (a ``ps`` job also has one server)."""
    jobs: int = 1
    """Jobs at once; 0 fills the hosts with as many jobs as fit."""
    jobs_placement: str = "spread"
    """How jobs take hosts: ``spread`` over the leaves in turn, or ``packed`` leaf by leaf."""
    workload: str = "resnet50"
    """The model profile every worker's gradients have (synthetic: the simulator trains nothing)."""
    scale: float = 0.01
    """Fraction of the model's tensor sizes (as the testbed's ``--scale``)."""
    iterations: int = 3
    compute_ms: float = 0.0
    loss_bound: float = 0.05
    ecn_backlog: str = Policy.ecn_backlog
    """What switch ports compare with the ECN threshold (:attr:`dlcp.hostagent.policy.Policy.ecn_backlog`)."""
    mtu: int = 1500
    schemes: tuple[str, ...] = ("baseline", "dlcp")
    warmup: int = 0
    """First iterations left out of the sync statistics (the testbed leaves out one)."""
    host_model: str = "dctcp"
    """The hosts' rate-control loop. ``dctcp``: a receiver reports every 16 data packets, a
    sender cuts at most once per cut interval (about a round trip and a buffer's drain) and,
    as DCTCP's window grows by a segment per round trip, grants ``additive_increase`` per cut
    interval; until its first cut it grants it per clean report, which grows the rate with
    itself, as TCP's slow start (fast at 10 Gb/s). ``agent``: the
    host agent's own rules, what the testbed runs: congestion reported at most every 2 ms, clean
    reports every 20 ms during a bulk transfer (else 200 ms) and free beside a STOP or BITMAP
    (:meth:`dlcp.hostagent.control_path.ControlPath._take_feedback`), a cut at most once per
    window (not again before every packet sent before it was reported), the increase granted
    per 2 ms since the last report (:meth:`dlcp.hostagent.ratecontrol.RateController.on_feedback`),
    and pacing by token buckets that let a burst of 16 packets leave at once
    (the data path's ``Pacer``, hostagent/native/pacer.h)."""
    background_load: float = 0.0
    """Background TCP flows' offered load, a fraction of each host's link (:mod:`dlcp_sim.background`)."""
    background_tcp: str = "dctcp"
    """The background flows' TCP: ``dctcp``, ``cubic`` or ``newreno``."""
    gradient_tcp: str = "dctcp"
    """The ``tcp`` scheme's congestion control for gradients: ``dctcp`` (with ECN), ``cubic`` or
    ``newreno``."""
    background_ms: float = 0.0
    """Flows start during the first this many ms; 0: twice the baseline's line-rate bound per
    iteration (plus compute), about as long as training lasts."""
    control_bytes: int = 0
    """Wire size of a control packet (STOP, PROBE, FEEDBACK; a BITMAP adds its bits); 0: the
    header and a body (60 bytes). The testbed's BMv2 ports serve packets, not bytes, so there a
    control frame (and the TCP ACK that answers it) costs a full packet's slot: give the
    datagram size (MTU - 28) to model that."""
    host_delay_us: float = 0.0
    """The hosts' software path, in microseconds: a message starts leaving this long after
    the workload hands it over, and every control packet (STOP, PROBE, BITMAP, FEEDBACK) this
    long after it was decided (the testbed's Python agents: packetizing, threads, control
    frames over TCP). A message's round, send to STOP, so takes two of them."""
    packet_slots: bool = False
    """Every packet crossing an uplink costs a full packet's time there, as on the testbed's BMv2
    ports, which are limited in packets per second, not bytes: a leaf pads what it sends up to
    the MTU (the receiving host trims it). A TCP ACK or a DLCP control packet then takes a data
    packet's slot (``control_bytes`` models that for DLCP's control packets alone)."""
    host_rate_gbps: float = 0.0
    """The link rate DLCP's hosts are configured for (``RateConfig.for_link``: their line rate, start
    and increase), Gb/s; 0: their own link's (``link_gbps``). The testbed configures its hosts for
    the fabric's rate, the capacity of its bottleneck ports, while their own links are not
    limited: give that rate here to model it."""
    wire_framing: bool = False
    """Every packet crossing an uplink costs its Ethernet frame on the wire, as on the testbed's
    ports with a capacity in bits per second (``dlcp run --capacity 10mbit``;
    :func:`dlcp.controller.scheduler.charge`): its IP packet plus the Ethernet header, FCS,
    preamble and inter-frame gap (38 bytes), at least 84 bytes. A leaf pads what it sends up by
    the difference from ns-3's point-to-point framing (:data:`PPP_HEADER`; the receiving host
    trims it). Without it an uplink charges an IP packet and 2 bytes: 2.4 % less for a full
    packet, half for a TCP ACK."""
    tcp_min_rto_us: float = 5000.0
    """TCP's minimum retransmission timeout (background flows and the ``tcp`` scheme), in
    microseconds; its delayed ACK is a fifth of it. The default is a data centre's 5 ms; Linux
    hosts, as on the testbed, use 200 ms (and delay ACKs by 40 ms): behind a slow bottleneck whose
    queue holds tens of milliseconds, 5 ms fires before the ACKs come and resends what was queued."""
    tcp_ack_every: int = 2
    """A TCP receiver ACKs every this many segments (the ``tcp`` scheme and background flows):
    2 is the delayed-ACK rule; gloo's receivers on the testbed sent 0.77 ACKs per segment
    (docs/results/sim-validation.md), nearer 1, and on ports that serve packets each ACK takes a
    data packet's slot."""
    seed: int = 0
    """Draws the synthetic gradients (so the drop classes), the flow hashes (which flows share a
    spine) and ns-3's random streams; repetitions are seeds."""

    def __post_init__(self) -> None:
        check_schemes(self.schemes, tuple(SIM_ONLY_SCHEMES))
        check_options(self, RANGES, CHOICES)
        if self.pattern == "ring" and self.workers < 2:
            raise UsageError("--workers: a ring needs at least 2")
        if self.warmup >= self.iterations:
            raise UsageError("--warmup must leave at least one measured iteration")
        if self.control_bytes and not HEADER_SIZE <= self.control_bytes <= self.mtu - IP_UDP_OVERHEAD:
            raise UsageError(f"--control-bytes must hold a DLCP header and fit a datagram: "
                                f"{HEADER_SIZE}..{self.mtu - IP_UDP_OVERHEAD}")
        if self.wire_framing and self.packet_slots:
            raise UsageError("--wire-framing and --packet-slots are two models of a port's charge: give one")
        if len(self.placement()) == 0:
            server = " and a server" if self.pattern == "ps" else ""
            raise UsageError(f"{self.hosts} hosts hold no job of {self.workers} workers{server}")

    @property
    def uplink_rate_gbps(self) -> float:
        return self.uplink_gbps or self.link_gbps

    @property
    def hosts(self) -> int:
        return self.leaves * self.hosts_per_leaf

    def placement(self) -> list[tuple[int | None, list[int]]]:
        """(server, workers) of every job, as host indices (server None for a ring).

        ``spread`` (default): hosts are taken leaf by leaf in turn (host 0 of every leaf, then
        host 1, ...), so a job spans leaves and its traffic crosses the spines. ``packed``:
        hosts in order, a leaf's hosts before the next leaf's (the testbed's ring: two
        neighbours on each leaf). A ``ps`` job's server is its last host."""
        if self.jobs_placement == "packed":
            order = list(range(self.hosts))
        else:
            order = [leaf * self.hosts_per_leaf + j for j in range(self.hosts_per_leaf) for leaf in range(self.leaves)]
        size = self.workers + (1 if self.pattern == "ps" else 0)
        fit = len(order) // size
        jobs = fit if self.jobs == 0 else min(self.jobs, fit)
        if self.jobs > fit:
            raise DlcpUserError(f"{self.jobs} jobs of {size} hosts do not fit in {self.hosts} hosts")
        out: list[tuple[int | None, list[int]]] = []
        for k in range(jobs):
            hosts = order[k * size: (k + 1) * size]
            out.append((hosts[-1], hosts[:-1]) if self.pattern == "ps" else (None, hosts))
        return out

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BucketPlan:
    """The packets of one bucket: priority and drop class of each."""

    priorities: np.ndarray
    drop_classes: np.ndarray


def _worker_plan(opts: SimOptions, policy: Policy) -> tuple[list[int], np.ndarray, list[Bucket]]:
    """One worker's (tensor sizes, priorities, buckets), as the testbed agent plans them."""
    return worker_plan({"model": opts.workload, "scale": opts.scale, "mtu": opts.mtu, "fusion": True}, policy)


def _plan(flat: np.ndarray, layout: Layout, per: int, policy: Policy) -> BucketPlan:
    """The packets of one message of ``flat`` elements laid out as ``layout``."""
    prio, _ = layout.packet_tags(per)
    classes = payload_drop_classes(flat, per, policy)
    return BucketPlan(np.asarray(prio, np.uint8), np.asarray(classes, np.uint8))


def bucket_plans(opts: SimOptions, policy: Policy) -> list[BucketPlan]:
    """Every message of one worker's iteration, packet by packet, as the testbed agent sends it.

    ``ps``: one plan per fused bucket. ``ring``: per bucket, the ``workers`` chunks
    :class:`~dlcp.hostagent.exchange.RingAllreduce` cuts it into (at ``linspace(0, n, W + 1)``, each
    chunk packetized on its own with its slice of the bucket's layout), bucket-major: chunk
    ``c`` of bucket ``b`` is plan ``b * workers + c``.
    """
    sizes, _, buckets = _worker_plan(opts, policy)
    rng = np.random.default_rng(opts.seed)
    grads = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    per = elems_per_packet(opts.mtu, np.float32)
    plans = []
    for b in buckets:
        flat = np.concatenate([grads[t] for t in b.tensors])
        if opts.pattern == "ps":
            plans.append(_plan(flat, b.layout, per, policy))
            continue
        cuts = np.linspace(0, b.total, opts.workers + 1).astype(np.int64)
        if np.any(np.diff(cuts) == 0):
            raise DlcpUserError(f"a bucket of {b.total} elements has an empty chunk in a ring of {opts.workers}; "
                                "raise --scale")
        for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            plans.append(_plan(flat[lo:hi], b.layout.slice(lo, hi), per, policy))
    return plans


def topology(opts: SimOptions) -> TopologyDesc:
    """The simulated leaf-spine as the testbed describes topologies, with the simulator's
    numbering (dlcp_sim/ns3/main.cc): host ``h`` is ``h<h>`` on leaf ``h // hosts_per_leaf``'s
    port ``h % hosts_per_leaf + 1``; leaf ``l``'s uplink to spine ``s`` is its port
    ``hosts_per_leaf + s + 1`` and the spine's port ``l + 1``. Every port is a bottleneck (all
    links have one rate)."""
    hpl = opts.hosts_per_leaf
    leaves = [f"l{i + 1}" for i in range(opts.leaves)]
    spines = [f"sp{s + 1}" for s in range(opts.spines)]
    hosts = tuple(HostDesc(f"h{h}", f"10.{h // hpl}.{h % hpl}.2", "", leaves[h // hpl], h % hpl + 1, "worker")
                  for h in range(opts.hosts))
    links = tuple(LinkDesc(leaves[i], hpl + s + 1, spines[s], i + 1)
                  for i in range(opts.leaves) for s in range(opts.spines))
    switches = tuple([SwitchDesc(name, i + 1, tuple(range(1, hpl + opts.spines + 1))) for i, name in enumerate(leaves)]
                     + [SwitchDesc(name, opts.leaves + s + 1, tuple(range(1, opts.leaves + 1)))
                        for s, name in enumerate(spines)])
    ports = frozenset((sw.name, p) for sw in switches for p in sw.ports)
    return TopologyDesc("sim-leafspine", switches, hosts, links, ports)


def line_rate_bound(opts: SimOptions, scheme: str) -> float:
    """Seconds the busiest link needs for one iteration's gradient packets, every job at once:
    each job's packets per host pair (:func:`dlcp.topologies.bound.job_traffic`, the testbed's
    rule, at least (1-p) of each message), split evenly over the equal-cost paths
    (:func:`dlcp.topologies.bound.port_loads`), on every switch port and every host's own link,
    each a full-size packet at that link's rate."""
    policy = sim_policy(scheme, opts)
    buckets = [b.total for b in _worker_plan(opts, policy)[2]]
    per = elems_per_packet(opts.mtu, np.float32)
    traffic: dict[tuple[str, str], float] = {}
    for server, workers in opts.placement():
        flows = job_traffic(opts.pattern, [f"h{w}" for w in workers], None if server is None else f"h{server}",
                            buckets, per, policy.loss_bound_push, policy.loss_bound_pull)
        for flow, packets in flows.items():
            traffic[flow] = traffic.get(flow, 0.0) + packets
    host_out = host_loads(traffic)
    host_s = opts.mtu * 8 / (opts.link_gbps * 1e9)
    up_s = opts.mtu * 8 / (opts.uplink_rate_gbps * 1e9)
    seconds = [p * host_s for p in host_out.values()]
    for (switch, port), packets in port_loads(topology(opts), traffic).items():
        to_host = switch.startswith("l") and port <= opts.hosts_per_leaf
        seconds.append(packets * (host_s if to_host else up_s))
    return max(seconds, default=0.0)


def background_flows(opts: SimOptions) -> list[BackgroundFlow]:
    """The background flows of ``opts`` (the same for every scheme of a seed)."""
    horizon = opts.background_ms / 1e3
    if horizon == 0:
        horizon = opts.iterations * (opts.compute_ms / 1e3 + 2 * line_rate_bound(opts, "baseline"))
    return generate(opts.hosts, opts.background_load, opts.link_gbps * 1e9, horizon, opts.seed)


def bucket_ready(opts: SimOptions, policy: Policy) -> list[float]:
    """When each bucket is full, as a fraction of the compute time: the testbed agent's
    backward pass makes tensors ready from the last to the first, each after its share of
    ``compute_ms`` by size, and a bucket leaves once its earliest tensor is ready."""
    sizes, _, buckets = _worker_plan(opts, policy)
    after = np.cumsum(np.asarray(sizes[::-1], dtype=np.float64))[::-1] / float(sum(sizes))  # tensors >= t
    return [float(after[min(b.tensors)]) for b in buckets]


def timers_us(opts: SimOptions) -> tuple[float, float]:
    """(answer_idle, probe_timeout) in microseconds. A receiver answers a probe once no data of
    the message arrived for about one full buffer's drain plus a base round trip (data merely
    queued is not reported missing); a probe unanswered for twice that plus a round trip is
    re-sent. The real transport measures both (dlcp.hostagent.ratecontrol.AnswerTimer). Packet times
    are taken at the slower of host links and uplinks, where queues build."""
    packet_us = opts.mtu * 8 / (min(opts.link_gbps, opts.uplink_rate_gbps) * 1e3)
    rtt = 8 * (opts.link_delay_us + packet_us)  # host-leaf-spine-leaf-host and back
    idle = opts.buffer * packet_us + rtt
    return idle, 2 * idle + rtt


def _dctcp_increase(opts: SimOptions) -> list[str]:
    """Scenario lines of the ``dctcp`` host model's increase: per cut interval after a
    destination's first cut, per clean report before it.

    Why per interval: reports come with a destination's packets, so an increase per report grows
    a fast sender more often than a slow one, which is multiplicative, not additive, and never
    evens out the senders' shares. In a 4-to-1 incast one worker then fell behind for good and
    its server waited for it on every bucket: spraying alone and priority queueing alone were
    13-22 % slower than the baseline on a fabric where neither had anything to act on (32 hosts,
    3 seeds). Per interval, every sender gains the same, as in DCTCP, and both match the baseline."""
    idle, _ = timers_us(opts)
    rc = RateConfig()
    return [f"increase_interval_us {idle:g}",
            f"max_increase_span_us {idle * rc.max_increase_span / rc.increase_interval:g}", "slow_start 1"]


def _agent_feedback(burst_bytes: int, timers: dict[str, float]) -> list[str]:
    """Scenario lines of the host agent's report timers, timed increase, cut once per window
    and token-bucket pacing of ``burst_bytes`` (``host_model agent``), from the agent's own
    configuration with ``timers`` set for the bottleneck as the testbed sets them
    (:func:`dlcp.hostagent.transport_config.link_timers`)."""
    tc: dict[str, Any] = {f.name: f.default for f in fields(TransportConfig)}  # its defaults (it needs peers to build)
    tc.update(timers)
    rc = RateConfig()
    return [f"burst_bytes {burst_bytes}", "cut_per_window 1", f"cut_hold_answers {CUT_HOLD_ANSWERS}",
            f"cut_hold_min_us {CUT_HOLD_MIN_REPORTS * tc['feedback_interval'] * 1e6:g}",
            f"initial_answer_us {tc['probe_delay'] * 1e6:g}",
            f"feedback_interval_us {tc['feedback_interval'] * 1e6:g}",
            f"bulk_feedback_interval_us {tc['bulk_feedback_interval'] * 1e6:g}",
            f"clean_feedback_interval_us {tc['clean_feedback_interval'] * 1e6:g}",
            f"bulk_feedback_packets {tc['bulk_feedback_packets']}",
            f"increase_interval_us {rc.increase_interval * 1e6:g}",
            f"max_increase_span_us {rc.max_increase_span * 1e6:g}",
            *_agent_end_of_pass(tc)]


def _agent_end_of_pass(tc: dict[str, Any]) -> list[str]:
    """Scenario lines of the agent's end of pass: LAST on a pass's final LAST_PACKETS packets,
    answered as a PROBE, a PROBE only when no answer came within the answer timer's delay, and
    the answer after the message's own quiet (:func:`dlcp.hostagent.protocol.incoming.answer_grace`).

    Why not the simulator's own timers (:func:`timers_us`): those wait out a full buffer's drain
    before answering, 91 ms at 700 packets/s; the agent waits four of the message's packet gaps.
    """
    return ["last_flag 1", f"last_packets {LAST_PACKETS}", f"answer_gaps {ANSWER_GAPS:g}",
            f"answer_grace_max_us {MAX_ANSWER_GRACE * 1e6:g}",
            f"probe_delay_min_us {tc['probe_delay_min'] * 1e6:g}",
            f"probe_delay_max_us {tc['probe_delay_max'] * 1e6:g}",
            f"answer_idle_us {tc['probe_grace'] * 1e6:g}"]


#: Bytes ns-3's point-to-point links add to an IP packet (a PPP header), charged at the link rate.
PPP_HEADER = 2


def wire_padding() -> list[str]:
    """The program's lines that make a leaf pad every packet it sends up to its Ethernet frame's
    charge on the testbed's ports (:attr:`SimOptions.wire_framing`): by the Ethernet header and the
    wire's overhead less ns-3's framing, and to at least the shortest frame's charge less it."""
    return [f"pad_by_bytes {ETH_HEADER + WIRE_OVERHEAD - PPP_HEADER}", f"pad_min_bytes {MIN_WIRE_FRAME - PPP_HEADER}"]


def scenario_text(opts: SimOptions, scheme: str) -> str:
    """The scenario file of one scheme (read by dlcp_sim/ns3/main.cc)."""
    policy = sim_policy(scheme, opts)
    # hosts configured as a user would, for their own link (bytes/s), unless told another rate (the testbed's)
    host = (opts.host_rate_gbps or opts.link_gbps) * 1e9 / 8
    rate = link_rates(host, opts.mtu)
    idle, probe = timers_us(opts)
    lines = [
        f"leaves {opts.leaves}", f"spines {opts.spines}", f"hosts_per_leaf {opts.hosts_per_leaf}",
        f"link_rate {opts.link_gbps * 1e3:g}Mbps", f"uplink_rate {opts.uplink_rate_gbps * 1e3:g}Mbps",
        f"link_delay_us {opts.link_delay_us:g}", f"mtu {opts.mtu}",
        f"buffer {opts.buffer}", f"ecn_threshold {policy.ecn_threshold}", f"ecn_backlog {policy.ecn_backlog}",
        "priority_map " + " ".join(str(q) for q in policy.priority_map + (0,) * (8 - len(policy.priority_map))),
        "drop_thresholds " + " ".join(str(t) for t in policy.drop_thresholds),
        f"lb {policy.lb_mode}", f"top_priority {policy.top_priority}",
        f"datagram {opts.mtu - IP_UDP_OVERHEAD}", f"control_bytes {opts.control_bytes or HEADER_SIZE + 16}",
        f"host_delay_us {opts.host_delay_us:g}", f"tcp_min_rto_us {opts.tcp_min_rto_us:g}",
        f"tcp_ack_every {opts.tcp_ack_every}",
        f"pad_to_bytes {opts.mtu if opts.packet_slots else 0}",
        *(wire_padding() if opts.wire_framing else []),
        f"line_rate {rate['line_rate']:g}", f"initial_rate {rate['initial_rate']:g}",
        f"min_rate {rate['min_rate']:g}", f"additive_increase {rate['additive_increase']:g}",
        f"gain {RateConfig().gain:g}", f"initial_alpha {INITIAL_ALPHA:g}",
        *(_agent_feedback(rate["burst_bytes"], link_timers(host, opts.mtu)) if opts.host_model == "agent"
          else _dctcp_increase(opts)),
        *([] if opts.host_model == "agent" else [f"answer_idle_us {idle:g}"]), f"probe_timeout_us {probe:g}",
        f"cut_interval_us {0 if opts.host_model == 'agent' else idle:g}",
        f"iterations {opts.iterations}", f"compute_s {opts.compute_ms / 1e3:g}", f"seed {opts.seed}",
        f"tcp {opts.background_tcp}", f"transport {'tcp' if scheme in SIM_ONLY_SCHEMES else 'dlcp'}",
        f"gradient_tcp {gradient_tcp(scheme, opts)}",
    ]
    lines.append("ready " + " ".join(f"{f:.6f}" for f in bucket_ready(opts, policy)))  # during backward
    for b in bucket_plans(opts, policy):
        lines.append(f"bucket {len(b.priorities)} {''.join(map(str, b.priorities))} "
                     f"{''.join(map(str, b.drop_classes))}")
    for server, workers in opts.placement():  # job <pattern> <push p> <pull p> [server] <n> <workers...>
        members = ([server] if server is not None else []) + [len(workers), *workers]
        lines.append(f"job {opts.pattern} {policy.loss_bound_push:g} {policy.loss_bound_pull:g} "
                     + " ".join(map(str, members)))
    lines += [f"flow {f.id} {f.src} {f.dst} {f.size} {f.start:.9f}" for f in background_flows(opts)]
    return "\n".join(lines) + "\n"
