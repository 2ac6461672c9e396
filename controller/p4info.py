"""The P4Info schema: the only place that knows IDs and bit widths.

Application code names tables, actions, match fields, parameters and counters; this module
turns names into IDs (any unique dotted suffix works: ``ipv4_lpm`` for
``DlcpIngress.forwarding.ipv4_lpm``) and says "did you mean" when a name is unknown.
Pure: it reads a P4Info file and answers questions, nothing else.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from p4.config.v1 import p4info_pb2

from dlcp.hostagent.errors import DlcpUserError


class SchemaError(DlcpUserError, LookupError):
    """A name the P4 program does not have."""


@dataclass(frozen=True)
class MatchField:
    name: str
    id: int
    bitwidth: int
    kind: str  # exact | lpm | ternary | range | optional


@dataclass(frozen=True)
class Param:
    name: str
    id: int
    bitwidth: int


@dataclass(frozen=True)
class ActionInfo:
    name: str
    id: int
    params: tuple[Param, ...]

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise SchemaError(f"action {self.name} has no parameter {name!r}"
                          f"{_suggest(name, [p.name for p in self.params])}; parameters: "
                          f"{[p.name for p in self.params]}")


@dataclass(frozen=True)
class TableInfo:
    name: str
    id: int
    match_fields: tuple[MatchField, ...]
    action_ids: tuple[int, ...]
    const_default: bool
    size: int

    def field(self, name: str) -> MatchField:
        for f in self.match_fields:
            if f.name == name:
                return f
        raise SchemaError(f"table {self.name} has no match field {name!r}"
                          f"{_suggest(name, [f.name for f in self.match_fields])}; fields: "
                          f"{[f.name for f in self.match_fields]}")


@dataclass(frozen=True)
class CounterInfo:
    name: str
    id: int
    size: int
    unit: str


_MATCH_KINDS = {p4info_pb2.MatchField.EXACT: "exact", p4info_pb2.MatchField.LPM: "lpm",
                p4info_pb2.MatchField.TERNARY: "ternary", p4info_pb2.MatchField.RANGE: "range",
                p4info_pb2.MatchField.OPTIONAL: "optional"}
_UNITS = {0: "unspecified", 1: "bytes", 2: "packets", 3: "both"}


def _suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    if not close:
        short = {c.rsplit(".", 1)[-1]: c for c in candidates}
        close = [short[c] for c in difflib.get_close_matches(name.rsplit(".", 1)[-1], list(short), n=1, cutoff=0.6)]
    return f". Did you mean {close[0]!r}?" if close else ""


class P4Schema:
    """Names, IDs and widths of one compiled P4 program."""

    def __init__(self, p4info: p4info_pb2.P4Info) -> None:
        self.p4info = p4info
        self.tables: dict[str, TableInfo] = {}
        self.actions: dict[str, ActionInfo] = {}
        self.counters: dict[str, CounterInfo] = {}
        for a in p4info.actions:
            params = tuple(Param(p.name, p.id, p.bitwidth) for p in a.params)
            self.actions[a.preamble.name] = ActionInfo(a.preamble.name, a.preamble.id, params)
        for t in p4info.tables:
            fields = tuple(MatchField(f.name, f.id, f.bitwidth, _MATCH_KINDS.get(f.match_type, "other"))
                           for f in t.match_fields)
            self.tables[t.preamble.name] = TableInfo(
                t.preamble.name, t.preamble.id, fields, tuple(r.id for r in t.action_refs),
                t.const_default_action_id != 0, t.size)
        for c in p4info.counters:
            self.counters[c.preamble.name] = CounterInfo(c.preamble.name, c.preamble.id, c.size,
                                                         _UNITS.get(c.spec.unit, "both"))
        self._action_by_id = {a.id: a for a in self.actions.values()}
        self._table_by_id = {t.id: t for t in self.tables.values()}

    @classmethod
    def load(cls, path: str | Path) -> P4Schema:
        """Read a P4Info text file (``.txtpb``/``.txt``) as p4c writes it."""
        p4info = p4info_pb2.P4Info()
        try:
            text_format.Parse(Path(path).read_text(), p4info)
        except (OSError, text_format.ParseError) as exc:
            raise DlcpUserError(f"cannot read P4Info {path}: {exc}") from exc
        return cls(p4info)

    @staticmethod
    def _resolve(kind: str, name: str, names: dict) -> str:
        if name in names:
            return name
        matches = [n for n in names if n.endswith("." + name) or n.split(".")[-1] == name]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise SchemaError(f"{kind} name {name!r} is ambiguous: {sorted(matches)}")
        raise SchemaError(f"no {kind} named {name!r}{_suggest(name, list(names))}")

    def table(self, name: str) -> TableInfo:
        """The table called ``name`` (full name or unique suffix)."""
        return self.tables[self._resolve("table", name, self.tables)]

    def action(self, name: str) -> ActionInfo:
        return self.actions[self._resolve("action", name, self.actions)]

    def counter(self, name: str) -> CounterInfo:
        return self.counters[self._resolve("counter", name, self.counters)]

    def table_by_id(self, table_id: int) -> TableInfo:
        return self._table_by_id[table_id]

    def action_by_id(self, action_id: int) -> ActionInfo:
        return self._action_by_id[action_id]

    def check_action_in_table(self, table: TableInfo, action: ActionInfo) -> None:
        if action.id not in table.action_ids:
            allowed = [self._action_by_id[i].name for i in table.action_ids]
            raise SchemaError(f"action {action.name} is not an action of table {table.name}; allowed: {allowed}")
