"""Read, diff, write: the difference between what a switch holds and what it should hold.

Pure: entries in (canonical, as :meth:`TableEntry.canonical` gives them), changes out.
Applying the changes and re-diffing gives nothing, which is what makes ``dlcpctl apply``
idempotent and lets it converge after a switch restart or an edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable
from typing import Literal

from dlcp.controller.entries import TableEntry
from dlcp.hostagent.errors import DlcpUserError

Kind = Literal["insert", "modify", "delete"]


@dataclass(frozen=True)
class Change:
    kind: Kind
    entry: TableEntry
    old: TableEntry | None = None

    def describe(self) -> str:
        sign = {"insert": "+", "modify": "~", "delete": "-"}[self.kind]
        return f"{sign} {self.entry.describe()}"


def check_unique(entries: Iterable[TableEntry], switch: str) -> None:
    """Two desired entries with the same key would fight: an error naming both."""
    seen: dict[tuple, TableEntry] = {}
    for e in entries:
        k = e.key()
        if k in seen:
            raise DlcpUserError(f"switch {switch}: two entries for the same key: "
                                f"{seen[k].describe()} and {e.describe()}")
        seen[k] = e


def diff(desired: Iterable[TableEntry], installed: Iterable[TableEntry], order: Iterable[str]) -> list[Change]:
    """Changes that turn ``installed`` into ``desired``.

    Args:
        order: full table names in dependency order (a route's group before the route):
            inserts and modifies follow it, deletes go in reverse.

    Default entries are only ever modified: a table always has one.
    """
    want = {e.key(): e for e in desired}
    have = {e.key(): e for e in installed}
    rank = {t: i for i, t in enumerate(order)}
    changes: list[Change] = []
    for k, e in want.items():
        old = have.get(k)
        if old is None:
            changes.append(Change("modify" if e.default else "insert", e))
        elif old != e:
            changes.append(Change("modify", e, old))
    deletes = [Change("delete", e) for k, e in have.items() if k not in want and not e.default]
    changes.sort(key=lambda c: rank.get(c.entry.table, len(rank)))
    deletes.sort(key=lambda c: -rank.get(c.entry.table, len(rank)))
    return deletes + changes
