"""Configuration of a transport endpoint: peers, loss injection, limits; and its counters.

Frozen dataclasses, validated at construction with errors that name the field; shared by
value between the endpoint, the exchange patterns, the PyTorch shim and the testbed agents.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from dlcp.hostagent import wire
from dlcp.hostagent.auth import parse_secret
from dlcp.hostagent.packetizer import DEFAULT_MTU
from dlcp.hostagent.policy import Policy
from dlcp.hostagent.ratecontrol import RateConfig


#: A receiver's congestion reports to one sender come at most once per this many packet times of
#: its link (:func:`link_timers`), as DCTCP's simulated hosts report once per 16 packets.
FEEDBACK_PACKETS = 16


def link_timers(link: float, mtu: int) -> dict[str, float]:
    """:class:`TransportConfig` knobs for hosts on links of ``link`` bytes/s, as
    :func:`dlcp.hostagent.ratecontrol.link_rates` gives the rate knobs: a congestion report at
    most every :data:`FEEDBACK_PACKETS` packet times of the link, and never more often than the
    default ``feedback_interval``.

    Why: the default (2 ms) is for links of gigabits, where it spans thousands of packets. Behind
    a bottleneck of 600 packets/s it spans about one, so a receiver whose packets are marked sent
    a FEEDBACK for nearly every packet it got; at top priority, on a bottleneck that counts
    packets, not bytes, the reports and their TCP acknowledgements took the bottleneck from the
    data they reported on. A sender cuts at most once per window anyway.
    """
    return {"feedback_interval": max(TransportConfig.feedback_interval, FEEDBACK_PACKETS * mtu / link)}


#: The per-packet paths: the compiled one (hostagent/native). (The numpy path is a reference model
#: in the tests now: tests/reference/numpy_path.py.)
DATAPATHS = ("native",)

#: Data sockets per destination with fixed source ports: one per priority queue (0..7).
PORTS_PER_DEST = 8


def source_ports(base: int, max_rank: int) -> tuple[int, int]:
    """The first and last UDP source port of data sockets from ``base`` to ranks 0..``max_rank``
    (:attr:`TransportConfig.source_port_base`): rank r's priority q leaves from ``base + 8 r + q``."""
    return base, base + PORTS_PER_DEST * (max_rank + 1) - 1


@dataclass(frozen=True)
class Peer:
    """Where one endpoint of the job listens."""

    rank: int
    host: str
    data_port: int = wire.DLCP_UDP_PORT
    control_port: int = wire.DLCP_UDP_PORT + 1


@dataclass(frozen=True)
class LossInjection:
    """Receiver-side faults for experiments and tests without a switch. Off by default.

    Applied to arriving data packets before reassembly and counted in the endpoint's stats.
    """

    drop_probabilities: tuple[float, ...] = ()
    """Drop probability per drop class (index = class); classes beyond the tuple are kept.
    ``(0, 0, 0.05, 0.05)`` drops 5 % of the two most droppable classes."""

    delay: float = 0.0
    """Seconds a delayed packet is held back."""

    delay_probability: float = 0.0
    """Fraction of packets delayed by ``delay``."""

    reorder: bool = False
    """Shuffle every received batch before reassembly."""

    seed: int = 0
    """Seed of the injection's random generator, so runs repeat."""

    def __post_init__(self) -> None:
        if any(not 0 <= p <= 1 for p in self.drop_probabilities):
            raise ValueError(f"LossInjection.drop_probabilities must be in [0, 1], got {self.drop_probabilities}")
        if self.delay < 0 or not 0 <= self.delay_probability <= 1:
            raise ValueError("LossInjection.delay must be >= 0 and delay_probability in [0, 1]")

    @property
    def enabled(self) -> bool:
        return any(self.drop_probabilities) or (self.delay > 0 and self.delay_probability > 0) or self.reorder


@dataclass(frozen=True)
class TransportConfig:
    """Everything an endpoint needs; frozen, shared by value."""

    rank: int
    """This endpoint's rank; must be one of ``peers``."""

    peers: tuple[Peer, ...]
    """Every endpoint of the job, this one included."""

    job_id: int = 1
    """Packets of other jobs are rejected."""

    policy: Policy = field(default_factory=Policy)
    """Tagging and completion policy (priorities, drop classes, loss bounds)."""

    mtu: int = DEFAULT_MTU
    """IP packet size of data packets."""

    rate: RateConfig = field(default_factory=RateConfig)
    """Rate control and pacing per destination."""

    loss: LossInjection = field(default_factory=LossInjection)
    """Receiver-side loss injection (off by default)."""

    connect_timeout: float = 10.0
    """How long to keep trying to reach a peer's control port."""

    message_deadline: float = 60.0
    """Hard deadline of a message, from its send or announcement."""

    idle_timeout: float = 0.05
    """Floor of the idle timeout: a message at >= (1-p) with nothing new for
    ``max(idle_timeout, 8 * srtt)`` completes even without the sender's PROBE."""

    probe_grace: float = 0.002
    """The reordering window a receiver assumes for a sender before it has measured that
    sender's path. A PROBE (or the end of a pass) is answered once no data of the message
    arrived for the window, or for four of the message's own mean packet gaps if longer
    (:func:`dlcp.hostagent.protocol.incoming.answer_grace`), so packets still in flight are not
    reported missing; the window then follows the reordering measured on the path
    (:data:`dlcp.hostagent.protocol.incoming.REORDER_MIN` and the rule beside it)."""

    feedback_interval: float = 0.002
    """How often a receiver reports congestion (CE marks, socket overruns) to a sender."""

    clean_feedback_interval: float = 0.2
    """How often a receiver reports packets received without congestion when no other control
    record is leaving for that sender (then the report rides along at once)."""

    bulk_feedback_interval: float = 0.02
    bulk_feedback_packets: int = 64
    """A clean report goes out every ``bulk_feedback_interval`` once ``bulk_feedback_packets``
    arrived since the last one: a long transfer's sender grows its rate by these reports (each
    grants at most ``RateConfig.max_increase_span`` of increase)."""

    probe_delay: float = 0.005
    """How long after its pass a sender waits for a STOP before it PROBEs, until it has
    measured its answer time; then ``answer time + 4 deviations`` within the two bounds below."""

    probe_delay_min: float = 0.001
    probe_delay_max: float = 0.5
    """(The data path holds a pass's end back from the control thread until its probe is due, and
    a held send's start ``probe_delay_min``: neither sets an earlier deadline.)"""

    rx_batch: int = 2048
    """Most datagrams received per reassembly batch (a batch also ends when the socket runs dry)."""

    socket_buffer: int = 64 * 1024 * 1024
    """SO_RCVBUF / SO_SNDBUF asked for: a limit, not an allocation. The kernel caps it at
    net.core.rmem_max / wmem_max (212 KB on a stock Linux) unless the process may exceed them
    (root, SO_RCVBUFFORCE); raise those with sysctl for rates near 10 Gb/s. Why this large: the
    windows receivers grant are a sixteenth of it in all (the kernel also keeps memory of
    datagrams already read charged to the socket, in steps of a quarter of the limit), and a
    receiver that falls behind for a few milliseconds must not lose what its senders put out
    meanwhile."""

    park_limit: int = 16384
    """Most early packets (data before their META or the receiver's ``recv``) held at once, per sender."""

    offload: bool = True
    """Use Linux UDP GSO to send up to 64 KB of equal-size datagrams per system call and UDP
    GRO to receive them in one read, where the kernel takes them (each falls back by itself
    otherwise). Turn it off where something between the hosts must see every datagram as a
    packet of its own but would be handed a GSO super-packet, such as a software switch
    reading a veth with a packet socket (the testbed turns it off)."""

    secret: bytes | None = field(default=None, repr=False)
    """The job secret (at least 16 bytes; hex text is accepted): control connections must prove
    it (:mod:`dlcp.hostagent.auth`). Every rank of the job needs the same one. Never printed."""

    encrypt: bool = False
    """Encrypt every data packet's payload (AES-128-GCM with the header as additional data), for
    jobs on networks others can read. Off, every datagram is still authenticated (a 128-bit
    AEGISMAC-128X4 tag over header and payload, :data:`dlcp.hostagent.wire.TRAILER_SIZE`), but gradients travel in
    the clear. Every rank of the job needs the same setting. See docs/design/security.md."""

    authenticate: bool = True
    """Check every datagram's tag (above). False sends the trailer with a zero tag and checks
    nothing: only to measure what the tag costs (``bench/transport.py --part protection``);
    any host that can reach the data port can then write into a message. Every rank of the job
    needs the same setting; ``encrypt`` needs it on."""

    check_address: bool = True
    """Accept a control connection for a rank only from the address that rank is configured at."""

    @property
    def protection(self) -> int:
        """What every datagram's trailer does, as the data paths' code for it: 0 nothing
        (``authenticate=False``), 1 a MAC over header and payload, 2 the payload encrypted too."""
        return 2 if self.encrypt else 1 if self.authenticate else 0

    datapath: str = "native"
    """Which per-packet path runs: ``native``, the compiled one (built by ``make setup``), the only
    one. (``numpy`` was a second; it needed the compiled module all the same and is a reference
    model in the tests now.)"""

    source_port_base: int | None = None
    """Send data to rank r at priority q from UDP source port ``source_port_base + 8 r + q``
    instead of an ephemeral one (None). Why: switches that hash flows (per-flow ECMP) choose a
    path from the 5-tuple, so with ephemeral ports every run draws its paths anew and two
    schemes compared in one repetition may meet different collisions; with one base per
    repetition, every scheme of that repetition takes the same paths, as the simulator's seeds
    pair them (:func:`source_ports`). The ports are per host: ranks that share an address and
    send to a common destination need different bases (a taken port stops the endpoint at start)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "secret", parse_secret(self.secret))
        ranks = [p.rank for p in self.peers]
        if self.encrypt and not self.authenticate:
            raise ValueError("TransportConfig.encrypt=True needs authenticate=True (encryption without the tag "
                             "would let anyone change the ciphertext unnoticed)")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"TransportConfig.peers has duplicate ranks: {ranks}")
        if self.rank not in ranks:
            raise ValueError(f"TransportConfig.rank={self.rank} is not among the peers' ranks {ranks}")
        if self.datapath not in DATAPATHS:
            removed = (" (the numpy data path is no longer part of the package: it needed the compiled module "
                       "anyway and is a reference model in DLCP's tests now)") if self.datapath == "numpy" else ""
            raise ValueError(f"TransportConfig.datapath={self.datapath!r} must be one of {DATAPATHS}{removed}")
        if self.bulk_feedback_packets < 1:
            raise ValueError(f"TransportConfig.bulk_feedback_packets={self.bulk_feedback_packets} must be >= 1")
        if not 1 <= self.rx_batch <= 65536:
            raise ValueError(f"TransportConfig.rx_batch={self.rx_batch} must be in 1..65536")
        if self.source_port_base is not None:
            lo, hi = source_ports(self.source_port_base, max(ranks))
            if lo < 1024 or hi > 65535:
                raise ValueError(f"TransportConfig.source_port_base={self.source_port_base}: its ports {lo}..{hi} "
                                 "must lie in 1024..65535")
            mine = self.peer(self.rank)
            if lo <= mine.data_port <= hi or lo <= mine.control_port <= hi:
                raise ValueError(f"TransportConfig.source_port_base={self.source_port_base}: its ports {lo}..{hi} "
                                 f"take this rank's data or control port ({mine.data_port}, {mine.control_port})")
        for name in ("connect_timeout", "message_deadline", "idle_timeout", "probe_grace", "feedback_interval",
                     "clean_feedback_interval", "bulk_feedback_interval", "probe_delay", "probe_delay_min",
                     "probe_delay_max"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransportConfig.{name} must be > 0, got {getattr(self, name)}")

    def peer(self, rank: int) -> Peer:
        for p in self.peers:
            if p.rank == rank:
                return p
        raise ValueError(f"unknown peer rank {rank}; known ranks: {[p.rank for p in self.peers]}")


@dataclass
class EndpointStats:
    """Totals of one endpoint since it started."""

    data_pkts_sent: int = 0
    data_bytes_sent: int = 0
    retransmitted_pkts: int = 0
    data_pkts_received: int = 0
    data_bytes_received: int = 0
    ce_marked: int = 0
    parked: int = 0
    late: int = 0
    rx_overflows: int = 0
    rx_dropped_estimate: int = 0
    injected_drops: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    injected_delays: int = 0
    send_errors: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    ctl_frames_sent: int = 0
    ctl_bytes_sent: int = 0
    ctl_frames_received: int = 0
    ctl_bytes_received: int = 0
    ctl_records_sent: Counter = field(default_factory=Counter)
    ctl_records_received: Counter = field(default_factory=Counter)
    probes_unknown: int = 0
    records_of_another_use: int = 0
    """PROBE, STOP, BITMAP or NACK records naming another use of a message id than the one
    this endpoint has (ids repeat every 1,024 calls): ignored."""
    messages_refused: int = 0
    """Receives failed because the sender's PROBE stated another shape (MessageMismatch)."""
    holes_reported: int = 0
    """Packets this endpoint reported missing before their pass ended (NACK, reliable messages)."""
    holes_resent: int = 0
    """Packets resent during their first pass because the receiver reported them (NACK)."""
    ctl_rejected: Counter = field(default_factory=Counter)
    """Control connections refused or dropped, by reason (wrong_address, bad_proof, ...)."""
    gso_calls: int = 0
    gro_reads: int = 0


def local_peers(n: int, base_port: int, host: str = "127.0.0.1") -> tuple[Peer, ...]:
    """``n`` peers on one host with consecutive ports (data, control) from ``base_port``."""
    return tuple(Peer(r, host, base_port + 2 * r, base_port + 2 * r + 1) for r in range(n))
