"""Table entries as small dataclasses, encoded to and decoded from P4Runtime messages.

A :class:`TableEntry` says what the application means, with names and plain values:
``TableEntry("ipv4_lpm", {"dst_addr": ("10.0.1.0", 24)}, "set_nexthop", {"port": 1, ...})``.
:meth:`TableEntry.encode` resolves names through the :class:`~dlcp.controller.p4info.P4Schema`
and writes canonical P4Runtime bytes (minimal big-endian strings; LPM host bits cleared),
so two entries that mean the same thing encode the same and compare equal after
:meth:`TableEntry.decode`. Encoding errors name the table and the field.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from p4.v1 import p4runtime_pb2

from dlcp.controller.p4info import P4Schema, SchemaError
from dlcp.hostagent.errors import DlcpUserError

_MAC = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")


class EntryError(DlcpUserError, ValueError):
    """An entry that cannot be encoded: names the table and the field."""


def value_to_int(value: Any) -> int:
    """An int from an int, a MAC ``aa:bb:..``, an IPv4 dotted quad, or a ``0x`` string."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a number")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        v = value.strip()
        if _MAC.match(v):
            return int(v.replace(":", ""), 16)
        if v.count(".") == 3:
            return int(ipaddress.IPv4Address(v))
        return int(v, 0)
    raise ValueError(f"{value!r} is not a number, MAC or IPv4 address")


def encode_value(value: int, bitwidth: int) -> bytes:
    """Canonical P4Runtime bytes: big-endian, no leading zero bytes, at least one byte."""
    if value < 0 or value >= (1 << bitwidth):
        raise ValueError(f"{value} does not fit in {bitwidth} bits")
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


def decode_value(raw: bytes) -> int:
    return int.from_bytes(raw, "big")


@dataclass(frozen=True)
class TableEntry:
    """One entry (or a table's default action, with ``default=True`` and no match)."""

    table: str
    match: Mapping[str, Any] = field(default_factory=dict)
    """Field name -> value (exact), or (value, prefix_len) for lpm."""
    action: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)
    default: bool = False

    def key(self) -> tuple:
        """Identity of the entry within its table (what insert/modify/delete address)."""
        return (self.table, self.default, tuple(sorted(self.match.items())))

    def canonical(self, schema: P4Schema) -> TableEntry:
        """Same entry with full names and int values, as :meth:`decode` would give it back."""
        return TableEntry.decode(self.encode(schema), schema)

    def encode(self, schema: P4Schema) -> p4runtime_pb2.TableEntry:
        """The P4Runtime message; raises :class:`EntryError` naming table and field."""
        try:
            table = schema.table(self.table)
        except SchemaError as exc:
            raise EntryError(str(exc)) from None
        msg = p4runtime_pb2.TableEntry(table_id=table.id)
        where = f"table {table.name}"
        if self.default:
            if self.match:
                raise EntryError(f"{where}: a default entry has no match fields")
            msg.is_default_action = True
        else:
            given = set(self.match)
            for name in given:
                try:
                    table.field(name)
                except SchemaError as exc:
                    raise EntryError(str(exc)) from None
            missing = [f.name for f in table.match_fields if f.kind in ("exact", "lpm") and f.name not in given]
            if missing:
                raise EntryError(f"{where}: match fields {missing} are required")
            for name, value in self.match.items():
                try:
                    f = table.field(name)
                except SchemaError as exc:
                    raise EntryError(str(exc)) from None
                fm = msg.match.add(field_id=f.id)
                try:
                    if f.kind == "exact":
                        fm.exact.value = encode_value(value_to_int(value), f.bitwidth)
                    elif f.kind == "lpm":
                        addr, plen = value if isinstance(value, (tuple, list)) else (value, f.bitwidth)
                        plen = int(plen)
                        if not 0 <= plen <= f.bitwidth:
                            raise ValueError(f"prefix length {plen} outside 0..{f.bitwidth}")
                        v = value_to_int(addr)
                        v &= ((1 << f.bitwidth) - 1) ^ ((1 << (f.bitwidth - plen)) - 1)
                        if plen == 0:
                            msg.match.pop()  # a /0 is expressed by leaving the field out
                            continue
                        fm.lpm.value = encode_value(v, f.bitwidth)
                        fm.lpm.prefix_len = plen
                    else:
                        raise ValueError(f"match kind {f.kind} is not supported")
                except ValueError as exc:
                    raise EntryError(f"{where}, match field {name}={value!r}: {exc}") from None
        if self.action:
            try:
                action = schema.action(self.action)
                schema.check_action_in_table(table, action)
            except SchemaError as exc:
                raise EntryError(f"{where}: {exc}") from None
            act = msg.action.action
            act.action_id = action.id
            names = {p.name for p in action.params}
            if set(self.params) != names:
                raise EntryError(f"{where}, action {action.name}: parameters {sorted(self.params)} given, "
                                 f"{sorted(names)} expected")
            for p in action.params:
                try:
                    act.params.add(param_id=p.id, value=encode_value(value_to_int(self.params[p.name]), p.bitwidth))
                except ValueError as exc:
                    raise EntryError(f"{where}, action {action.name}, parameter {p.name}="
                                     f"{self.params[p.name]!r}: {exc}") from None
        elif not self.default:
            raise EntryError(f"{where}: an entry needs an action")
        return msg

    @classmethod
    def decode(cls, msg: p4runtime_pb2.TableEntry, schema: P4Schema) -> TableEntry:
        """From a P4Runtime message (as read from a switch), with full names and ints."""
        table = schema.table_by_id(msg.table_id)
        by_id = {f.id: f for f in table.match_fields}
        match: dict[str, Any] = {}
        for fm in msg.match:
            f = by_id[fm.field_id]
            if fm.HasField("lpm"):
                match[f.name] = (decode_value(fm.lpm.value), fm.lpm.prefix_len)
            else:
                match[f.name] = decode_value(fm.exact.value)
        for f in table.match_fields:  # a /0 reads back without the field
            if f.kind == "lpm" and f.name not in match and not msg.is_default_action:
                match[f.name] = (0, 0)
        action, params = "", {}
        if msg.HasField("action") and msg.action.HasField("action"):
            a = schema.action_by_id(msg.action.action.action_id)
            action = a.name
            by_pid = {p.id: p.name for p in a.params}
            params = {by_pid[p.param_id]: decode_value(p.value) for p in msg.action.action.params}
        return cls(table.name, match, action, params, msg.is_default_action)

    def describe(self) -> str:
        """One line for people: ``ipv4_lpm dst_addr=10.0.1.0/24 -> set_nexthop(port=1, ...)``."""
        short = self.table.rsplit(".", 1)[-1]
        if self.default:
            head = f"{short} (default)"
        else:
            parts = []
            for k, v in self.match.items():
                if isinstance(v, tuple):
                    parts.append(f"{k}={_fmt_addr(v[0])}/{v[1]}")
                else:
                    parts.append(f"{k}={v}")
            head = f"{short} {' '.join(parts)}"
        args = ", ".join(f"{k}={_fmt_param(k, v)}" for k, v in self.params.items())
        return f"{head} -> {self.action.rsplit('.', 1)[-1]}({args})"


def _fmt_addr(v: Any) -> str:
    return str(ipaddress.IPv4Address(v)) if isinstance(v, int) else str(v)


def _fmt_param(name: str, v: Any) -> str:
    if isinstance(v, int) and name.endswith("mac"):
        return ":".join(f"{(v >> s) & 0xFF:02x}" for s in range(40, -8, -8))
    return str(v)
