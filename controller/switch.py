"""One switch under control: compute what it should hold, read what it holds, converge.

``apply`` pushes the pipeline only when its cookie differs (a fresh or restarted switch),
reads the installed entries of the tables DLCP owns, writes only the difference,
re-asserts the BMv2 queue settings and installs (or updates in place) the scheduler of every
bottleneck port on its interface (:mod:`dlcp.controller.scheduler`). Everything is validated and encoded
before the first write, so a mistake in the network file never leaves a switch
half-configured; a second ``apply`` writes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from collections.abc import Iterable, Sequence

from p4.v1 import p4runtime_pb2

from dlcp.controller import desired as desired_mod
from dlcp.controller import priority_queue, scheduler
from dlcp.controller.bmv2_thrift import SimpleSwitchThrift
from dlcp.controller.entries import TableEntry
from dlcp.controller.network import Network, SwitchSpec
from dlcp.controller.p4info import P4Schema
from dlcp.controller.p4rt import Pipeline, SwitchConnection
from dlcp.controller.reconcile import Change, check_unique, diff

log = logging.getLogger(__name__)

#: Counters per egress port x queue, in the order reports show them.
PORT_QUEUE_COUNTERS = ("admitted", "forwarded", "selective_dropped", "tail_dropped", "ecn_marked")
DROP_REASONS = ("none", "no_route", "ttl_expired", "not_ipv4", "tail", "selective", "no_group")
NUM_QUEUES = 8


@dataclass
class ApplyReport:
    """What one apply did (or, with ``dry_run``, would do) to one switch."""

    switch: str
    pipeline_pushed: bool = False
    changes: list[Change] = field(default_factory=list)
    queue_settings: int = 0
    schedulers: int = 0
    """Bottleneck ports whose scheduler was installed or re-asserted."""
    dry_run: bool = False

    @property
    def writes(self) -> int:
        """P4Runtime entity writes (the pipeline push not included)."""
        return len(self.changes)

    def counts(self) -> dict[str, int]:
        out = {"insert": 0, "modify": 0, "delete": 0}
        for c in self.changes:
            out[c.kind] += 1
        return out

    def as_dict(self) -> dict:
        return {"switch": self.switch, "pipeline_pushed": self.pipeline_pushed, **self.counts(),
                "queue_settings": self.queue_settings, "schedulers": self.schedulers, "dry_run": self.dry_run,
                "changes": [c.describe() for c in self.changes]}


def plan_entries(spec: SwitchSpec, net: Network, schema: P4Schema,
                 tables: Iterable[str] | None = None) -> list[TableEntry]:
    """The canonical entries ``spec`` should hold (restricted to ``tables`` if given).

    Raises:
        EntryError / SchemaError: an entry does not fit the program (names table and field).
    """
    wanted = desired_mod.desired_entries(spec, net)
    canon = [e.canonical(schema) for e in wanted]
    check_unique(canon, spec.name)
    if tables is not None:
        full = {schema.table(t).name for t in tables}
        canon = [e for e in canon if e.table in full]
    return canon


class Switch:
    """A connection to one switch plus the knowledge of what it should hold."""

    def __init__(self, spec: SwitchSpec, schema: P4Schema, pipeline: Pipeline, timeout: float = 5.0) -> None:
        self.spec = spec
        self.schema = schema
        self.pipeline = pipeline
        self.conn = SwitchConnection(spec.name, spec.grpc, spec.device_id, timeout=timeout)
        self.thrift = SimpleSwitchThrift(spec.thrift_host, spec.thrift_port, timeout=timeout, netns=spec.netns)

    def __enter__(self) -> Switch:
        self.conn.open()
        return self

    def __exit__(self, *exc) -> None:
        self.conn.close()

    # --- reading ------------------------------------------------------------------------
    def managed_tables(self, net: Network) -> list[str]:
        """Full names of the tables apply reconciles, in dependency order."""
        names = [self.schema.table(t).name for t in desired_mod.owned_tables()]
        for e in self.spec.extra_entries:
            t = self.schema.table(e.table).name
            if t not in names:
                names.append(t)
        return names

    def read_entries(self, tables: Sequence[str], with_defaults: Sequence[str] = ()) -> list[TableEntry]:
        ids = [self.schema.table(t).id for t in tables]
        dflt = [self.schema.table(t).id for t in with_defaults]
        return [TableEntry.decode(m, self.schema) for m in self.conn.read_table_entries(ids, dflt)]

    def busy_service(self) -> dict[int, tuple[int, int]]:
        """Per egress port with traffic: (service intervals, their total microseconds) measured
        while the port was backlogged (the P4 program's ``busy_gaps`` / ``busy_gap_us``
        registers, cumulative; see ``p4/include/control/stats.p4``). Their ratio is the rate
        the port achieved while it had work."""
        gaps = self.thrift.register_read_all("busy_gaps")
        micros = self.thrift.register_read_all("busy_gap_us")
        return {port: (n, us) for port, (n, us) in enumerate(zip(gaps, micros)) if n}

    def counters(self) -> dict:
        """Counters, non-zero rows only: ``ports`` (per egress port x queue: admitted, forwarded,
        dropped, marked), ``drop_reasons``, ``selective_drops_by_class`` and ``received`` (frames the
        pipeline took in, per ingress port)."""
        raw = {name: self.conn.read_counter(self.schema.counter(name).id) for name in PORT_QUEUE_COUNTERS}
        rows = []
        for index in sorted(set().union(*(set(k for k, v in c.items() if v[0]) for c in raw.values()))):
            row = {"port": index // NUM_QUEUES, "queue": index % NUM_QUEUES}
            for name in PORT_QUEUE_COUNTERS:
                pkts, byts = raw[name].get(index, (0, 0))
                row[f"{name}_pkts"] = pkts
                row[f"{name}_bytes"] = byts
            rows.append(row)
        reasons = self.conn.read_counter(self.schema.counter("drop_reason").id)
        drops = {DROP_REASONS[i] if i < len(DROP_REASONS) else str(i): v[0] for i, v in sorted(reasons.items()) if v[0]}
        by_class = self.conn.read_counter(self.schema.counter("selective_dropped_class").id)
        classes = {i: v[0] for i, v in sorted(by_class.items()) if v[0]}
        received = self.conn.read_counter(self.schema.counter("received").id)
        return {"switch": self.spec.name, "ports": rows, "drop_reasons": drops, "selective_drops_by_class": classes,
                "received": {port: v[0] for port, v in sorted(received.items()) if v[0]}}

    # --- converging -----------------------------------------------------------------------
    def plan(self, net: Network, tables: Iterable[str] | None = None) -> tuple[bool, list[Change]]:
        """(pipeline needs pushing, changes to the tables) for ``net``."""
        want = plan_entries(self.spec, net, self.schema, tables)
        push = self.conn.pipeline_cookie() != self.pipeline.cookie
        scope = self.managed_tables(net) if tables is None else [self.schema.table(t).name for t in tables]
        defaults = sorted({e.table for e in want if e.default})
        # a new pipeline starts empty, with its P4 defaults: everything must be written
        have = [] if push else [e for e in self.read_entries(scope, defaults)
                                if not e.default or e.table in defaults]
        return push, diff(want, have, scope)

    def apply(self, net: Network, tables: Iterable[str] | None = None, dry_run: bool = False,
              queues: bool = True) -> ApplyReport:
        """Converge the switch on ``net`` (all DLCP tables, or just ``tables``)."""
        push, changes = self.plan(net, tables)
        report = ApplyReport(self.spec.name, push, changes, dry_run=dry_run)
        if dry_run:
            return report
        if push:
            log.info("switch %s: pushing pipeline (cookie %x)", self.spec.name, self.pipeline.cookie)
            self.conn.set_pipeline(self.pipeline)
        updates = [p4runtime_pb2.Update(type=getattr(p4runtime_pb2.Update, c.kind.upper()),
                                        entity=p4runtime_pb2.Entity(table_entry=c.entry.encode(self.schema)))
                   for c in changes]
        self.conn.write(updates)
        if queues:
            report.queue_settings = self.apply_queues()
            report.schedulers = self.apply_schedulers()
        return report

    def apply_schedulers(self) -> int:
        """Install or update the scheduler of every bottleneck port (idempotent: ``tc replace``)."""
        return scheduler.install([p.scheduler() for p in sorted(self.spec.ports.values(), key=lambda p: p.number)
                                  if p.is_bottleneck], self.spec.netns)

    def scheduler_stats(self) -> dict[int, scheduler.QdiscStats]:
        """Per bottleneck port: its scheduler's counters (sent, dropped, queued now)."""
        ifaces = {p.interface: p.number for p in self.spec.ports.values() if p.is_bottleneck and p.interface}
        if not ifaces:
            return {}
        reader = scheduler.QdiscReader(self.spec.netns, list(ifaces))
        try:
            return {ifaces[i]: st for i, st in reader.read().items()}
        finally:
            reader.close()

    def apply_queues(self) -> int:
        """Re-assert BMv2 rates and depths of bottleneck ports (Thrift has no getter: always set)."""
        settings = priority_queue.queue_settings(self.spec)
        for s in settings:
            self.thrift.set_queue_depth(s.port, s.depth, s.priority)
            self.thrift.set_queue_rate(s.port, s.rate_pps, s.priority)
        return len(settings)
