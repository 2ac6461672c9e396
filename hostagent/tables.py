"""Results that are tables: what a benchmark measures, kept as a file beside its results page.

A benchmark (``bench/transport.py``, ``bench/sim.py``) builds :class:`Table` s as it measures,
prints them on the console and, with ``--out FILE``, writes them with the run's provenance; ``dlcp
report FILE`` prints the same tables as Markdown. So a page's figures are the numbers the run
recorded, formatted once, not copied from a terminal.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dlcp.hostagent.provenance import provenance, provenance_lines

#: What ``kind`` a tables file says it is, so a report tells it from a run's results.
KIND = "tables"


@dataclass
class Column:
    """A column's heading and how its numbers are shown (``"{:.1f}"``); text cells show as they
    are. Columns align right (numbers) unless ``left``; a table's first column always aligns left."""

    name: str
    fmt: str = "{}"
    left: bool = False

    def show(self, value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return self.fmt.format(value)
        return str(value)


@dataclass
class Table:
    """One table: a title, columns, rows of values (numbers kept as numbers) and notes on how to read it."""

    title: str
    columns: list[Column]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title}: a row of {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(list(cells))

    def _left(self, i: int) -> bool:
        return i == 0 or self.columns[i].left

    def cells(self) -> list[list[str]]:
        return [[c.show(v) for c, v in zip(self.columns, row)] for row in self.rows]

    def text(self) -> str:
        """For the console: columns padded to their widest cell, the first left-aligned."""
        shown = self.cells()
        widths = [max(len(c.name), *(len(r[i]) for r in shown)) if shown else len(c.name)
                  for i, c in enumerate(self.columns)]

        def line(cells: list[str]) -> str:
            padded = (c.ljust(w) if self._left(i) else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            return "   " + "  ".join(padded)

        return "\n".join([self.title, line([c.name for c in self.columns]), *(line(r) for r in shown),
                          *self.notes]) + "\n"

    def markdown(self) -> str:
        head = "| " + " | ".join(c.name for c in self.columns) + " |"
        rule = "|" + "|".join("---" if self._left(i) else "---:" for i in range(len(self.columns))) + "|"
        body = ["| " + " | ".join(r) + " |" for r in self.cells()]
        notes = ["", *self.notes] if self.notes else []
        return "\n".join([f"**{self.title}**", "", head, rule, *body, *notes]) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> Table:
        return cls(d["title"], [Column(**c) for c in d["columns"]], [list(r) for r in d["rows"]], list(d["notes"]))


@dataclass
class Record:
    """What made a benchmark's tables (its command, commit, start and machine): printed before
    them on the console and kept with them in the file."""

    provenance: dict
    machine: str

    @classmethod
    def start(cls, program: str, args: Sequence[str] | None = None) -> Record:
        """``program``: how the benchmark is run (``python bench/transport.py``); ``args``: its
        arguments, when they are not this process's."""
        made = provenance(time.strftime("%Y-%m-%d %H:%M:%S %Z"), program=program, args=args)
        return cls(made, f"{os.cpu_count()} CPUs, {platform.system()} {platform.release()}")

    def header(self) -> str:
        return (f"$ {self.provenance['command']}\n"
                f"commit {self.provenance['commit']}, {self.machine}, {self.provenance['started']}\n")

    def keep(self, path: Path | None, tables: list[Table]) -> None:
        """Write ``tables`` to ``path`` (nothing without one); call it after every part, so a
        benchmark that stops keeps what it measured."""
        if path is not None:
            write(path, tables, self.provenance, {"machine": self.machine})


def write(path: Path, tables: list[Table], provenance: dict, extra: dict | None = None) -> None:
    """Keep ``tables`` with what made them (and ``extra``: the machine, say) as JSON at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"kind": KIND, "provenance": provenance, **(extra or {}), "tables": [asdict(t) for t in tables]}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def is_tables(results: object) -> bool:
    return isinstance(results, dict) and results.get("kind") == KIND and isinstance(results.get("tables"), list)


def markdown(results: dict, source: str = "") -> str:
    """A tables file as a results page's section: what made it, then every table."""
    lines = provenance_lines(results, source)
    machine = results.get("machine")
    if machine:
        lines += [f"Machine: {machine}.", ""]
    return "\n".join([*lines, *(Table.from_dict(t).markdown() for t in results["tables"])])
