"""The compiled data path (``dlcp.hostagent._datapath``) as a :class:`~dlcp.hostagent.protocol.port.DataPort`.

Builds the extension's configuration from the one definition of each fact (the header layout
from :mod:`dlcp.hostagent.wire`, tags from the :class:`~dlcp.hostagent.policy.Policy`, limits from the
:class:`~dlcp.hostagent.transport_config.TransportConfig`) and keeps every buffer the compiled code
reads or writes alive until that message is retired or forgotten: the extension holds raw
pointers, never references.

Why C++ with nanobind, built by scikit-build-core: the per-packet work (system calls, header
checks, copies, bitmaps) must run on threads that do not share the interpreter lock with the
training process, or the receiver drains only as fast as Python's slowest thread lets it;
nanobind is small, binds numpy arrays without copies and releases the lock per call, and
scikit-build-core builds it from ``pyproject.toml`` with the system's compiler and CMake, so a
plain ``pip install`` builds it too.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlcp.hostagent import _datapath, wire
from dlcp.hostagent.datapath.config import _raw, native_config
from dlcp.hostagent.datapath.offline import Placement
from dlcp.hostagent.packetizer import MessageMeta, elems_per_packet, packetize
from dlcp.hostagent.protocol.port import REASONS, Event, Progress, RxSpec, TxInfo, TxSpec
from dlcp.hostagent.transport_config import TransportConfig

@dataclass(frozen=True)
class CreditGrant:
    """A credit the receive side grants (:meth:`NativeDatapath.credits_for_test`)."""

    rank: int
    window: int
    """Packets the sender may have unconsumed beyond ``consumed``."""
    consumed: int
    """The sender's packets taken from the socket, or counted as never coming."""
    release: bool
    """RELEASE: what the sender sent and was not consumed was lost."""
    datagram: bytes
    """As it goes on the wire, sealed under the key of our direction to ``rank``."""


class NativeDatapath:
    """One endpoint's compiled data path: a receive and a send thread outside the interpreter."""

    name = "native"

    def __init__(self, config: TransportConfig, udp: socket.socket, gro: bool) -> None:
        self.config = config
        self.gro = gro
        self._dp = _datapath.Datapath(native_config(config, udp.fileno(), gro))
        self._rx_refs: dict[tuple[int, int], RxSpec] = {}
        self._tx_refs: dict[tuple[int, int], TxSpec] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._dp.start()

    def stop(self) -> None:
        """Stop both threads and close the data sockets; afterwards no buffer is read or written."""
        self._dp.close()
        self._rx_refs.clear()
        self._tx_refs.clear()

    def event_fd(self) -> int:
        return self._dp.event_fd()

    def deferred_event_fd(self) -> int:
        """A second fd that becomes readable when events the data path holds back are due: a
        pass's end when its PROBE is (:meth:`set_probe_delay`), a held send that started
        ``probe_delay_min`` after it, unless another event woke :meth:`event_fd` first.
        :meth:`take_events` takes both."""
        return self._dp.deferred_event_fd()

    def take_events(self) -> list[Event]:
        return self._dp.take_events()

    def calibrate(self) -> float:
        """Bytes/s this host's validation and placement take, on a synthetic batch (about a
        millisecond): a start-up ceiling for senders until the drain is measured under load.
        Half of it is offered, as the system calls cost the rest.

        The batch is what real data costs: sealed as this endpoint's peers seal (its tag checked,
        its payload decrypted where the endpoint encrypts) and placed, by the receive thread's
        own code (:class:`~dlcp.hostagent.datapath.offline.Placement`). Why it says so: unsealed,
        every packet was rejected at its tag and this timed the rejection instead."""
        cfg = self.config
        per = elems_per_packet(cfg.mtu, np.float32)
        n = min(cfg.rx_batch, 512)
        data = np.zeros(n * per, np.float32)
        place = Placement(config=cfg)
        best = 0.0
        for mid in range(1, 4):
            meta = MessageMeta(job_id=cfg.job_id, message_id=mid, sender_rank=place.sender)
            batch = packetize(data, meta, cfg.policy, cfg.mtu)
            rows, sizes = place.rows(batch)
            place.expect(mid, batch)
            t0 = time.perf_counter()
            reasons = place.ingest(rows, sizes)
            elapsed = time.perf_counter() - t0
            if reasons.any():
                why = ", ".join(REASONS[r] for r in sorted(set(reasons.tolist()) - {0}))
                raise RuntimeError(f"the data path's calibration rejected its own packets ({why})")
            best = max(best, float(sizes.sum()) / max(1e-6, elapsed))
        return best / 2

    # ------------------------------------------------------------------ DataPort
    def add_peer(self, rank: int, ipv4: str, port: int) -> None:
        self._dp.add_peer(rank, ipv4, port)

    def set_keys(self, rank: int, rx_key: bytes | None, tx_key: bytes | None) -> None:
        self._dp.set_rx_key(rank, rx_key or b"")
        self._dp.set_tx_key(rank, tx_key or b"")

    def expect(self, spec: RxSpec) -> None:
        b = spec.buffers
        self._dp.expect(spec.src, spec.message_id, spec.token, spec.dtype, spec.total_elems, spec.elems_per_packet,
                        _raw(b.out.reshape(-1)), spec.accumulate, int(wire.dtype_code(b.out.dtype)), b.received,
                        b.pkt_priority, b.pkt_layer,
                        spec.required_elems, list(spec.triggers), float(spec.scale), spec.iteration,
                        spec.classify)
        self._rx_refs[(spec.src, spec.message_id)] = spec

    def progress(self, src: int, message_id: int) -> Progress | None:
        p = self._dp.progress(src, message_id)
        return None if p is None else Progress(*p)

    def progress_changed(self) -> dict[tuple[int, int], Progress]:
        return {(src, mid): Progress(*p) for src, mid, p in self._dp.progress_changed()}

    def complete(self, src: int, message_id: int, fire: bool) -> bool:
        return self._dp.complete(src, message_id, fire)

    def forget(self, src: int, message_id: int, remember: bool) -> None:
        self._dp.forget(src, message_id, remember)
        self._rx_refs.pop((src, message_id), None)

    def expire_parked(self, older_than: float) -> None:
        self._dp.expire_parked(older_than)

    def take_feedback(self, src: int) -> tuple[int, int, int]:
        return self._dp.take_feedback(src)

    def active_senders(self, now: float, window: float) -> int:
        return self._dp.active_senders(now, window)

    def drain_rate(self, now: float) -> float:
        return self._dp.drain_rate(now)

    def rx_seen_until(self) -> float:
        return self._dp.rx_seen_until()

    def reorder_window(self, src: int) -> float:
        return self._dp.reorder_window(src)

    def holes(self, src: int, message_id: int) -> np.ndarray:
        return np.array(self._dp.holes(src, message_id), np.int64)

    def submit(self, spec: TxSpec) -> None:
        snapshot = None if spec.snapshot is None else _raw(spec.snapshot)
        self._dp.submit(spec.dest, spec.message_id, _raw(spec.payload.reshape(-1)), spec.dtype, spec.payload.size,
                        spec.elems_per_packet, spec.token, spec.iteration, spec.tensor_id, spec.layer, spec.priority,
                        spec.pkt_priority, spec.pkt_layer, spec.drop_class, snapshot, spec.held, spec.order,
                        spec.tags_given)
        self._tx_refs[(spec.dest, spec.message_id)] = spec

    def retransmit(self, dest: int, message_id: int, seqs: np.ndarray) -> int:
        return self._dp.retransmit(dest, message_id, [int(s) for s in seqs])

    def resend(self, dest: int, message_id: int, seqs: np.ndarray) -> int:
        return self._dp.resend(dest, message_id, [int(s) for s in seqs])

    def tx_info(self, dest: int, message_id: int) -> TxInfo | None:
        t = self._dp.tx_info(dest, message_id)
        return None if t is None else TxInfo(*t)

    def retire(self, dest: int, message_id: int) -> None:
        self._dp.retire(dest, message_id)
        self._tx_refs.pop((dest, message_id), None)

    def set_rate(self, dest: int, rate: float) -> None:
        self._dp.set_rate(dest, rate)

    def set_probe_delay(self, dest: int, seconds: float) -> None:
        self._dp.set_probe_delay(dest, seconds)

    def sent_packets(self, dest: int) -> int:
        return self._dp.sent_packets(dest)

    def failure(self) -> str | None:
        """Why a thread of the data path failed and stopped (None: none did): it caught what it
        raised, reported it (EventKind.FAILED) and stopped; the process goes on."""
        return self._dp.failure() or None

    def fault_for_test(self, thread: str) -> None:
        """Make the ``"receive"`` or ``"send"`` thread raise std::bad_alloc at its next turn."""
        self._dp.fault_for_test({"receive": 1, "send": 2}[thread])

    def end_passes_for_test(self, now: float, seen_until: float) -> float:
        """The receive thread's completion of bounded messages at the end of their pass, on a
        given clock, the reader having read all that arrived before ``seen_until``; returns
        when the next is due (0: none)."""
        return float(self._dp.end_passes_for_test(now, seen_until))

    def ingest_for_test(self, slots: np.ndarray, lengths: np.ndarray, now: float) -> None:
        """Validate and place a batch of datagrams (rows of ``slots``) as the receive thread
        would, without a socket: for tests and calibration."""
        self._dp.ingest_for_test(np.ascontiguousarray(slots, np.uint8), np.asarray(lengths, np.int64), now)

    def credits_for_test(self, now: float, seen_until: float,
                         socket_memory: int = 0) -> tuple[float, list[CreditGrant]]:
        """The credits the receive thread would grant at ``now``, every datagram that reached
        the host before ``seen_until`` read, for a socket of ``socket_memory`` bytes (0: as
        measured at start); each is taken as sent. Returns when the next falls due (0: none)
        and the credits, each with its sealed datagram."""
        wake, credits = self._dp.credits_for_test(now, seen_until, socket_memory)
        return float(wake), [CreditGrant(*c) for c in credits]

    def account_reads_for_test(self, reads: int, overflow: int, now: float) -> None:
        """The receive thread's overrun accounting after ``reads`` socket-buffer entries were
        read and the socket's drop counter read ``overflow`` (-1: no count came)."""
        self._dp.account_reads_for_test(reads, overflow, now)

    def drain_batch_for_test(self, started: float, nbytes: int, behind: bool, now: float) -> None:
        """One receive batch for the drain meter: begun at ``started``, ``nbytes`` read, ended at
        ``now``, ``behind`` (it ended full with the socket still half full)."""
        self._dp.drain_batch_for_test(started, nbytes, behind, now)

    def set_sockopt(self, dest: int, priority: int, level: int, name: int, value: int) -> None:
        """Set an option on the data socket to ``dest`` for ``priority`` (made now if need be)."""
        self._dp.set_sockopt(dest, priority, level, name, value)

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict[str, Any]:
        """Counters, under the names :meth:`dlcp.hostagent.transport.Endpoint.endpoint_stats` reports."""
        s: dict[str, Any] = dict(self._dp.stats())
        s["rejected"] = dict(self._dp.rejected())
        s["injected_drops"] = {int(k): int(v) for k, v in self._dp.injected_drops().items()}
        s["data_sockets"] = sorted(tuple(x) for x in self._dp.data_sockets())
        s["gso_off"] = list(self._dp.gso_off_reasons())
        return s
