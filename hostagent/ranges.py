"""Numeric ranges of options, defined once: the library's checks and the command lines' parsers
both read them, so an option's allowed values and its error message cannot drift apart.

``Range(0.0, 0.5)`` reads "0..0.5"; ``Range(1)`` ">= 1"; ``Range(0, lo_open=True)`` "> 0".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dlcp.hostagent.errors import UsageError


@dataclass(frozen=True)
class Range:
    """An interval of allowed values; either end may be missing (unbounded) or open."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.lo is not None and not (value > self.lo if self.lo_open else value >= self.lo):
            return False
        if self.hi is not None and not (value < self.hi if self.hi_open else value <= self.hi):
            return False
        return not math.isnan(value)  # NaN is in no range

    def __str__(self) -> str:
        lo, hi = _num(self.lo), _num(self.hi)
        if self.lo is not None and self.hi is not None:
            if not self.lo_open and not self.hi_open:
                return f"{lo}..{hi}"
            return f"{'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {lo}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {hi}"
        return "any number"

    def problem(self, value: object) -> str | None:
        """Why ``value`` is not allowed, phrased for an error message; None when it is."""
        if value in self:
            return None
        two_sided = self.lo is not None and self.hi is not None
        return f"{_num(value)} is outside {self}" if two_sided else f"{_num(value)} is not {self}"

    def check(self, option: str, value: object) -> None:
        """Raises :class:`UsageError` naming ``option`` when ``value`` is outside the range."""
        why = self.problem(value)
        if why is not None:
            raise UsageError(f"{option}: {why}")


def _num(value: object) -> str:
    """``0.5`` -> ``"0.5"``, ``2.0`` -> ``"2"``: numbers as a user would type them."""
    return f"{value:g}" if isinstance(value, float) else str(value)
