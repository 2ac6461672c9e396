"""A simulated experiment as data, and the scenario file the C++ simulator reads.

Pure: options and a scheme in, text out. Every policy fact comes from the same places the
testbed reads: the scheme's :class:`~hostagent.policy.Policy` (:mod:`topologies.schemes`), the
worker's buckets (:func:`topologies.workload.worker_plan`: the model profile, fusion, layer
priorities), per-packet priorities of fused buckets (:func:`hostagent.policy.packet_tags`) and
drop classes from the magnitudes of synthetic gradients drawn as the testbed agent draws them
(:func:`hostagent.policy.drop_classes`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from hostagent.errors import DlcpUserError
from hostagent.packetizer import elems_per_packet
from hostagent.policy import Policy, drop_classes, packet_magnitudes, packet_tags
from hostagent.ratecontrol import RateConfig
from hostagent.wire import HEADER_SIZE, IP_UDP_OVERHEAD
from topologies.schemes import check_schemes, policy_for
from topologies.workload import worker_plan

#: Model profiles the simulator can send (hostagent.model_profiles).
MODELS = ("resnet50", "vgg16", "transformer")


@dataclass(frozen=True)
class SimOptions:
    """One ``dlcp sim`` experiment: a leaf-spine, its jobs, the workload and the schemes."""

    leaves: int = 2
    spines: int = 2
    hosts_per_leaf: int = 4
    link_gbps: float = 10.0
    link_delay_us: float = 1.0
    buffer: int = 100
    """Packets a switch port holds ahead of a packet before it tail-drops it (per port, as the
    testbed's virtual queue)."""
    workers: int = 4
    """Workers per job; each job also has one parameter server."""
    jobs: int = 1
    """Jobs at once; 0 fills the hosts with as many jobs as fit."""
    model: str = "resnet50"
    scale: float = 0.01
    """Fraction of the model's tensor sizes (as the testbed's ``--scale``)."""
    iterations: int = 3
    compute_ms: float = 0.0
    loss_bound: float = 0.05
    mtu: int = 1500
    schemes: tuple[str, ...] = ("baseline", "dlcp")
    seed: int = 0
    """Draws the synthetic gradients (so the drop classes), the flow hashes (which flows share a
    spine) and ns-3's random streams; repetitions are seeds."""

    def __post_init__(self) -> None:
        check_schemes(self.schemes)
        if self.model not in MODELS:
            raise DlcpUserError(f"--model {self.model!r}: the simulator sends model profiles {list(MODELS)}")
        for name in ("leaves", "spines", "hosts_per_leaf", "workers", "iterations", "buffer"):
            if getattr(self, name) < 1:
                raise DlcpUserError(f"--{name.replace('_', '-')} must be at least 1")
        if self.leaves > 250 or self.spines > 250 or self.hosts_per_leaf > 250:
            raise DlcpUserError("--leaves, --spines and --hosts-per-leaf are at most 250 (addresses 10.leaf.host.2)")
        if self.jobs < 0 or self.link_gbps <= 0 or self.link_delay_us < 0 or self.compute_ms < 0:
            raise DlcpUserError("--jobs, --link-gbps, --link-delay-us and --compute-ms must not be negative")
        if not 0 <= self.loss_bound < 1:
            raise DlcpUserError(f"--loss-bound must be in [0, 1), got {self.loss_bound}")
        if len(self.placement()) == 0:
            raise DlcpUserError(f"{self.hosts} hosts hold no job of {self.workers} workers and a server")

    @property
    def hosts(self) -> int:
        return self.leaves * self.hosts_per_leaf

    def placement(self) -> list[tuple[int, list[int]]]:
        """(server, workers) of every job, as host indices. Hosts are taken leaf by leaf in turn
        (host 0 of every leaf, then host 1, ...), so a job spans leaves and its traffic crosses
        the spines; the server is a job's last host."""
        order = [leaf * self.hosts_per_leaf + j for j in range(self.hosts_per_leaf) for leaf in range(self.leaves)]
        size = self.workers + 1
        fit = len(order) // size
        jobs = fit if self.jobs == 0 else min(self.jobs, fit)
        if self.jobs > fit:
            raise DlcpUserError(f"{self.jobs} jobs of {size} hosts do not fit in {self.hosts} hosts")
        return [(order[k * size + self.workers], order[k * size: k * size + self.workers]) for k in range(jobs)]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BucketPlan:
    """The packets of one bucket: priority and drop class of each."""

    priorities: np.ndarray
    drop_classes: np.ndarray


def bucket_plans(opts: SimOptions, policy: Policy) -> list[BucketPlan]:
    """Every bucket of one worker's iteration, packet by packet, as the testbed agent sends it."""
    spec = {"model": opts.model, "scale": opts.scale, "mtu": opts.mtu, "fusion": True}
    sizes, _, buckets = worker_plan(spec, policy)
    rng = np.random.default_rng(opts.seed)
    grads = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    per = elems_per_packet(opts.mtu, np.float32)
    plans = []
    for b in buckets:
        flat = np.concatenate([grads[t] for t in b.tensors])
        prio, _ = packet_tags(b.layout.starts, b.layout.priorities, b.layout.layers, b.total, per)
        classes = drop_classes(packet_magnitudes(flat, per, policy.magnitude), policy)
        plans.append(BucketPlan(np.asarray(prio, np.uint8), np.asarray(classes, np.uint8)))
    return plans


def timers_us(opts: SimOptions) -> tuple[float, float]:
    """(answer_idle, probe_timeout) in microseconds. A receiver answers a probe once no data of
    the message arrived for about one full buffer's drain plus a base round trip (data merely
    queued is not reported missing); a probe unanswered for twice that plus a round trip is
    re-sent. The real transport measures both (hostagent.ratecontrol.AnswerTimer)."""
    packet_us = opts.mtu * 8 / (opts.link_gbps * 1e3)
    rtt = 8 * (opts.link_delay_us + packet_us)  # host-leaf-spine-leaf-host and back
    idle = opts.buffer * packet_us + rtt
    return idle, 2 * idle + rtt


def scenario_text(opts: SimOptions, scheme: str) -> str:
    """The scenario file of one scheme (read by dlcp_sim/ns3/main.cc)."""
    policy = policy_for(scheme, opts.buffer, opts.loss_bound)
    line = opts.link_gbps * 1e9 / 8
    rate = RateConfig()
    idle, probe = timers_us(opts)
    lines = [
        f"leaves {opts.leaves}", f"spines {opts.spines}", f"hosts_per_leaf {opts.hosts_per_leaf}",
        f"link_rate {opts.link_gbps * 1e3:g}Mbps", f"link_delay_us {opts.link_delay_us:g}",
        f"buffer {opts.buffer}", f"ecn_threshold {policy.ecn_threshold}",
        "priority_map " + " ".join(str(q) for q in policy.priority_map + (0,) * (8 - len(policy.priority_map))),
        "drop_thresholds " + " ".join(str(t) for t in policy.drop_thresholds),
        f"lb {policy.lb_mode}", f"top_priority {policy.top_priority}",
        f"datagram {opts.mtu - IP_UDP_OVERHEAD}", f"control_bytes {HEADER_SIZE + 16}",
        f"line_rate {line:g}", f"initial_rate {line * rate.initial_rate / rate.line_rate:g}",
        f"min_rate {rate.min_rate:g}", f"additive_increase {line / 100:g}", f"gain {rate.gain:g}",
        f"answer_idle_us {idle:g}", f"probe_timeout_us {probe:g}", f"cut_interval_us {idle:g}",
        f"iterations {opts.iterations}", f"compute_s {opts.compute_ms / 1e3:g}", f"seed {opts.seed}",
    ]
    for b in bucket_plans(opts, policy):
        lines.append(f"bucket {len(b.priorities)} {''.join(map(str, b.priorities))} "
                     f"{''.join(map(str, b.drop_classes))}")
    for server, workers in opts.placement():
        lines.append(f"job ps {policy.loss_bound_push:g} {policy.loss_bound_pull:g} {server} {len(workers)} "
                     + " ".join(map(str, workers)))
    return "\n".join(lines) + "\n"
