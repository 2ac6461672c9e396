"""The schemes an experiment compares, and the policy each one means: one definition, read by
the testbed (:mod:`dlcp.topologies.runner`) and the simulator (:mod:`dlcp_sim`).

``baseline`` is one FIFO queue, per-flow ECMP, a reliable transport and no selective drops;
``dlcp`` turns on all of DLCP's mechanisms; the others turn on one each (ablations).

The testbed also runs what users run instead of DLCP (:data:`GLOO_SCHEMES`): stock
``DistributedDataParallel`` over ``torch.distributed``'s gloo backend (TCP), alone, with
PyTorch's own compression hooks, or over TCP that reacts to the switches' ECN marks
(:data:`GLOO_TCP`), on the baseline's fabric. Each of DLCP's schemes also runs
with its gradients as float16 on the wire (``dlcp-fp16``, :data:`FP16_SCHEMES`), as ``gloo-fp16``
sends them. ``dlcp-backend`` (:data:`BACKEND_SCHEMES`) is how PyTorch users run DLCP: gloo's
stock-DDP script with ``init_process_group("dlcp")``, the backend's defaults, on ``dlcp``'s
fabric. A scheme on the command line may name its communication pattern (``dlcp:ring``), so
DLCP's PS and ring run beside gloo's ring in one interleaved run.
"""

from __future__ import annotations

import dataclasses

from dlcp.hostagent.errors import DlcpUserError
from dlcp.hostagent.policy import PATTERNS, Policy

#: Which mechanisms each scheme turns on.
SCHEMES: dict[str, dict[str, bool]] = {
    "baseline": {"prio": False, "lb": False, "drop": False, "bounded": False},
    "dlcp": {"prio": True, "lb": True, "drop": True, "bounded": True},
    "lb": {"prio": False, "lb": True, "drop": False, "bounded": False},
    "prio": {"prio": True, "lb": False, "drop": False, "bounded": False},
    "drop": {"prio": False, "lb": False, "drop": True, "bounded": False},
    "bounded": {"prio": False, "lb": False, "drop": False, "bounded": True},
}


#: What users run, by testbed scheme: stock DDP over gloo, with the DDP communication hook named
#: (None: DDP's own all-reduce). Every one runs on the baseline's fabric (:func:`fabric_of`).
GLOO_SCHEMES: dict[str, str | None] = {"gloo": None, "gloo-fp16": "fp16", "powersgd": "powersgd",
                                       "gloo-ecn": None, "gloo-dctcp": None}

#: What users run over DLCP, by testbed scheme: stock ``DistributedDataParallel`` over
#: ``init_process_group("dlcp")`` with the backend's defaults (:mod:`dlcp_torch.backend`), the
#: gloo agent's very script with another backend's name, on the fabric named (the switches of
#: that DLCP scheme). Why: DLCP's own agents drive its exchange directly, which no PyTorch user
#: does; this is the configuration users get, measured beside ``gloo`` in the same run.
BACKEND_SCHEMES: dict[str, str] = {"dlcp-backend": "dlcp"}

#: Every scheme a stock ``torch.distributed`` script runs (DDP's own all-reduce or a hook):
#: gloo's and the DLCP backend's. Their all-reduce is a ring; they run on training workloads or
#: (gloo's) on synthetic buckets.
TORCH_SCHEMES: tuple[str, ...] = (*GLOO_SCHEMES, *BACKEND_SCHEMES)

#: How a gloo scheme's hosts run TCP, where it is not the testbed's (``--host-tcp``, Cubic by
#: default, without ECN): the sysctls of each worker's namespace while it trains. Why: the
#: switches mark CE on ECN-capable packets past their ECN threshold whatever the scheme, but
#: stock Linux TCP does not ask for ECN, so stock gloo never sees a mark and learns of a full
#: queue only by losing packets in it. ``gloo-dctcp`` is what a datacenter tunes gloo to:
#: DCTCP, which cuts its window in proportion to the marks (the kernel's ``dctcp``, or where the
#: kernel has none the same algorithm in BPF, :mod:`dlcp.topologies.bpf_dctcp`, which the runner
#: puts in its place: :func:`dlcp.topologies.runner.gloo_tcp`); ``gloo-ecn`` asks for ECN with
#: the host's own congestion control (Cubic then halves its window at a mark instead of at a
#: loss), which every kernel has.
GLOO_TCP: dict[str, dict[str, str]] = {
    "gloo-ecn": {"net.ipv4.tcp_ecn": "1"},
    "gloo-dctcp": {"net.ipv4.tcp_congestion_control": "dctcp", "net.ipv4.tcp_ecn": "1"},
}

#: Each DLCP scheme with its gradients as float16 on the wire (``dlcp-fp16``: half the bytes,
#: as ``gloo-fp16`` sends them), by the scheme whose fabric and policy it runs.
FP16_SCHEMES: dict[str, str] = {f"{s}-fp16": s for s in SCHEMES}

def fabric_of(scheme: str) -> str:
    """The :data:`SCHEMES` entry whose switches and policy ``scheme`` runs on: gloo's schemes
    run on the baseline's (one FIFO queue, per-flow ECMP), as a user's cluster is; ``dlcp-fp16``
    on ``dlcp``'s; the DLCP backend's on the one :data:`BACKEND_SCHEMES` names."""
    if scheme in GLOO_SCHEMES:
        return "baseline"
    return BACKEND_SCHEMES.get(scheme) or FP16_SCHEMES.get(scheme, scheme)


def torch_backend_of(scheme: str) -> str | None:
    """The ``torch.distributed`` backend a stock-DDP scheme (:data:`TORCH_SCHEMES`) runs over:
    ``gloo`` or ``dlcp``; None for DLCP's own agents."""
    if scheme in GLOO_SCHEMES:
        return "gloo"
    return "dlcp" if scheme in BACKEND_SCHEMES else None


def wire_dtype_of(scheme: str) -> str:
    """The element type a DLCP scheme's gradients travel in (``DLCPState(wire_dtype=...)``)."""
    return "float16" if scheme in FP16_SCHEMES else "float32"


def mechanisms(scheme: str) -> dict[str, bool]:
    """Which of DLCP's mechanisms ``scheme``'s fabric and transport turn on."""
    return SCHEMES[fabric_of(scheme)]


def split_label(label: str, pattern: str) -> tuple[str, str]:
    """(scheme, pattern) of a scheme as given on the command line: ``dlcp:ring`` names its
    pattern, ``dlcp`` takes the run's ``pattern``; stock DDP's schemes (gloo's, the DLCP
    backend's) always run a ring.

    Raises:
        DlcpUserError: an unknown pattern, or a parameter server asked of gloo.
    """
    scheme, _, named = label.partition(":")
    if named and named not in PATTERNS:
        raise DlcpUserError(f"scheme {label!r}: unknown pattern {named!r}; choose from {list(PATTERNS)}")
    if scheme in TORCH_SCHEMES:
        if named == "ps":
            raise DlcpUserError(f"scheme {label!r}: stock DDP has no parameter server (its all-reduce is a ring)")
        return scheme, "ring"
    return scheme, named or pattern


def check_schemes(schemes: tuple[str, ...], extra: tuple[str, ...] = ()) -> None:
    """Raises DlcpUserError naming what is unknown, or that none was given; ``extra``: names a
    caller knows besides :data:`SCHEMES` (the simulator's ``tcp``)."""
    known = [*SCHEMES, *extra]
    bad = [s for s in schemes if s not in known]
    if bad or not schemes:
        raise DlcpUserError(f"unknown scheme(s) {bad}; choose from {known}")


#: The smallest port buffer a scheme's policy can be derived from: its quarter, the last drop
#: threshold, must be at least one packet (:class:`~dlcp.hostagent.policy.Policy`'s check).
MIN_BUFFER = 4


def policy_for(scheme: str, buffer: int, loss_bound: float, ecn_backlog: str = Policy.ecn_backlog,
               base: Policy | None = None) -> Policy:
    """The policy of one scheme at a port buffer of ``buffer`` packets: what is off falls back
    to the baseline's behaviour (one queue, flow hashing, no drop classes, p = 0). Every scheme
    marks ECN at a quarter of the buffer, on ``ecn_backlog`` (:attr:`Policy.ecn_backlog`; with
    one queue, as the baseline has, both rules are the same).

    With ``base`` (a policy file), what a scheme turns on is taken from it (its priority map,
    load-balancing mode, drop classes and thresholds, ECN threshold) instead of being derived
    from ``buffer``, so the file's tuning is what the experiment measures; ``loss_bound`` and
    ``ecn_backlog`` still come from the run's options."""
    on = mechanisms(scheme)
    ref = base if base is not None else Policy()
    thresholds = ref.drop_thresholds if base is not None else (buffer * 3 // 4, buffer // 2, buffer // 4)
    return dataclasses.replace(
        ref,
        priority_map=ref.priority_map if on["prio"] else (0,) * len(ref.priority_map),
        lb_mode=ref.lb_mode if on["lb"] else "flow",
        num_drop_classes=ref.num_drop_classes if on["drop"] else 1,
        drop_class_shares=ref.drop_class_shares if on["drop"] else None,
        drop_thresholds=thresholds if on["drop"] else (),
        ecn_threshold=ref.ecn_threshold if base is not None else max(1, buffer // 4),
        ecn_backlog=ecn_backlog,
        loss_bound_push=loss_bound if on["bounded"] else 0.0,
    )
