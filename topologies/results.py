"""One results file for every experiment: the testbed's runs (``dlcp run``) and the simulator's
(``dlcp sim``) write the same shape, and ``dlcp report`` reads it through :func:`load`.

Why one shape: a study compares the testbed with the simulator, and a reader (a results page,
a plotting script, someone's notebook) should find a run's schemes, repetitions and figures
in the same place whichever made them. Schema 2, in ``results.json``::

    {
      "schema": 2,
      "source": "testbed" | "simulator",   # which made it; what its per-run detail holds
      "options": {...},                    # what ran: RunOptions or SimOptions as a dict
      "provenance": {...},                 # command, commit, time (dlcp.hostagent.provenance)
      "reference": "baseline",             # the scheme speedups are paired against (None: none ran)
      "runs": [                            # one per scheme and repetition, in the order they ran
        {"scheme": "dlcp", "repeat": 0, "seed": 1 | None,
         "metrics": {<CORE_METRICS>, ... the source's own},
         ... the source's per-run detail (testbed: iterations, switches, validity, cross, bound,
             tcp_counters; simulator: iterations_detail, ports)}
      ],
      "summary": {"dlcp": {...}, ...}      # per scheme, medians and intervals as written
    }

Files of schema 1 (the testbed's ``{config, schemes: [...]}`` and the simulator's ``{options,
runs: {scheme: [...]}}``, written before commit 71a1d02) are read by :func:`upgrade`, so kept results
stay readable. Pure functions, dicts in and dicts out, but :func:`load`, which reads a file.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: This module's results schema; a file says which it follows in ``schema``.
SCHEMA = 2
#: What can make a results file.
SOURCES = ("testbed", "simulator")

#: Every run's metrics have these (a source may add its own), named alike in both sources.
CORE_METRICS: dict[str, str] = {
    "sync_p50_ms": "sync time (last gradient ready to last average in), median over measured iterations, ms",
    "sync_p99_ms": "the same, 99th percentile, ms",
    "iteration_p50_ms": "iteration time, median over measured iterations, ms",
    "sync_over_bound": "sync p50 over the line-rate bound of the busiest link (None without a bound)",
    "retransmitted": "data packets sent again",
    "tail_drops": "packets the switches dropped because a queue was full",
    "selective_drops": "packets the switches dropped by drop class, {class: count}",
    "missing_fraction": "share of the gradient packets zero-filled at completion (bounded loss)",
}

#: Schema 1's testbed metric names that schema 2 names as the simulator did.
_RENAMED_METRICS = {"retransmissions": "retransmitted", "switch_tail_drops": "tail_drops",
                    "switch_selective_drops_by_class": "selective_drops", "lost_fraction_mean": "missing_fraction"}


class ResultsError(ValueError):
    """A file that is not a results file this code reads, and why."""


def document(source: str, options: dict, runs: list[dict], *, provenance: dict | None, reference: str | None,
             summary: dict | None = None, **extra: Any) -> dict:
    """A results file's contents; ``extra`` keeps what a source adds at the top (the testbed's
    topology name, the simulator's seed count).

    Raises:
        ValueError: an unknown source, or a run without a scheme or metrics.
    """
    if source not in SOURCES:
        raise ValueError(f"unknown results source {source!r}; one of {SOURCES}")
    for r in runs:
        if "scheme" not in r or "repeat" not in r:
            raise ValueError(f"a run needs a scheme and a repeat: {sorted(r)}")
    return {"schema": SCHEMA, "source": source, "options": options, "provenance": provenance,
            "reference": reference, "runs": runs, "summary": summary or {}, **extra}


def schemes(results: dict) -> list[str]:
    """The schemes in the order they first ran."""
    return list(dict.fromkeys(r["scheme"] for r in results["runs"]))


def by_scheme(results: dict) -> dict[str, list[dict]]:
    """Each scheme's runs by repetition, schemes in the order they first ran."""
    out: dict[str, list[dict]] = {s: [] for s in schemes(results)}
    for r in results["runs"]:
        out[r["scheme"]].append(r)
    return {s: sorted(rs, key=lambda r: r.get("repeat", 0)) for s, rs in out.items()}


def repetitions(results: dict) -> int:
    """How many times each scheme ran (the most any did; repetitions may be numbered from other
    than 0: ``dlcp run --first-repeat``)."""
    return max(Counter(r["scheme"] for r in results["runs"]).values(), default=0)


def slim(results: dict, keep: Iterable[str]) -> dict:
    """``results`` with each run cut to its scheme, repetition, seed, metrics and the keys in
    ``keep``: small enough to keep beside a results page, all its tables need."""
    fields = ("scheme", "repeat", "seed", "metrics", *keep)
    return {**results, "runs": [{k: r[k] for k in fields if k in r} for r in results["runs"]]}


def upgrade(raw: Any) -> dict:
    """A loaded results file in schema 2, whichever schema it was written in.

    Raises:
        ResultsError: it is not a results file, or of a schema newer than this code.
    """
    if not isinstance(raw, dict):
        raise ResultsError("not a results file (not a JSON object)")
    if "schema" in raw:
        if raw["schema"] != SCHEMA:
            raise ResultsError(f"results schema {raw['schema']!r}; this version of dlcp reads {SCHEMA} and 1")
        if raw.get("source") not in SOURCES or not isinstance(raw.get("runs"), list):
            raise ResultsError(f"schema {SCHEMA} results without a known source or a list of runs")
        return raw
    if isinstance(raw.get("schemes"), list):
        return _testbed_v1(raw)
    if isinstance(raw.get("options"), dict) and isinstance(raw.get("runs"), dict):
        return _simulator_v1(raw)
    raise ResultsError("not a run's results (neither schemes nor runs)")


def load(path: Path) -> dict:
    """The results file at ``path`` in schema 2.

    Raises:
        ResultsError: unreadable, not JSON, or not a results file.
    """
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ResultsError(f"cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ResultsError(f"not JSON ({exc})") from None
    return upgrade(raw)


def core_metrics(metrics: dict) -> dict:
    """Schema 1's testbed metrics under schema 2's names (others pass unchanged); a run without
    a line-rate bound says so with ``sync_over_bound`` None, as schema 2's runs do."""
    return {"sync_over_bound": None, **{_RENAMED_METRICS.get(k, k): v for k, v in metrics.items()}}


def _testbed_v1(raw: dict) -> dict:
    """``{config, topology, reference, provenance, schemes: [...], aggregate}``."""
    runs = [{**s, "metrics": core_metrics(s["metrics"])} if isinstance(s.get("metrics"), dict) else dict(s)
            for s in raw["schemes"]]
    rest = {k: v for k, v in raw.items() if k not in ("config", "schemes", "aggregate", "provenance", "reference")}
    return document("testbed", raw.get("config", {}), runs, provenance=raw.get("provenance"),
                    reference=raw.get("reference") or "baseline", summary=raw.get("aggregate"), **rest)


def _simulator_v1(raw: dict) -> dict:
    """``{options, repeat, provenance, summary, runs: {scheme: [flat per-seed records]}}``."""
    detail = ("iterations_detail", "ports")
    seed = raw["options"].get("seed")
    runs = []
    for scheme, records in raw["runs"].items():
        for i, rec in enumerate(records):
            metrics = {k: v for k, v in rec.items() if k not in detail and k != "scheme"}
            if isinstance(metrics.get("selective_drops"), list):
                metrics["selective_drops"] = {str(c): n for c, n in enumerate(metrics["selective_drops"])}
            runs.append({"scheme": scheme, "repeat": i, "seed": None if seed is None else seed + i,
                         "metrics": metrics, **{k: rec[k] for k in detail if k in rec}})
    runs.sort(key=lambda r: r["repeat"])  # the order they ran: every scheme of a seed, then the next seed
    rest = {k: v for k, v in raw.items() if k not in ("options", "runs", "summary", "provenance")}
    reference = "baseline" if "baseline" in raw["runs"] else next(iter(raw["runs"]), "baseline")
    return document("simulator", raw["options"], runs, provenance=raw.get("provenance"), reference=reference,
                    summary=raw.get("summary"), **rest)


#: Options that may differ between the runs :func:`merge` joins: how many repetitions each ran
#: and from which, and what only steers the runner (where it wrote, its output, its limits).
MERGE_FREE = frozenset({"repeat", "first_repeat", "out", "quiet", "timeout", "strict"})


def merge(documents: list[tuple[str, dict]]) -> dict:
    """Runs of one experiment made at different times (``dlcp run --first-repeat``), as one
    results document: their runs together, repetitions numbered as they ran, options those
    they share, provenance every part's (command, commit and start, joined with "; ").

    Why: an interval needs 5 paired repetitions, and a run can leave fewer (an invalid run, a
    seed that missed the target). Repetitions added later must measure what the earlier ones
    did, so every other option must be the same, and no repetition of a scheme may come twice.

    ``documents``: ``(name, results)`` pairs in schema 2, the name only for messages.

    Raises:
        ResultsError: fewer than two, not all the testbed's, options that differ (named), or a
            scheme's repetition in two of them.
    """
    if len(documents) < 2:
        raise ResultsError("--merge needs at least two results files")
    first_name, first = documents[0]
    runs: list[dict] = []
    seen: dict[tuple[str, int], str] = {}
    for name, doc in documents:
        if doc.get("source") != "testbed":
            raise ResultsError(f"{name}: --merge joins testbed runs; this is the {doc.get('source')}'s")
        for key in sorted((set(doc["options"]) | set(first["options"])) - MERGE_FREE):
            mine, theirs = doc["options"].get(key), first["options"].get(key)
            if mine != theirs:
                raise ResultsError(f"{name}: option {key} is {mine!r}, in {first_name} {theirs!r}: "
                                   "only runs of one experiment merge")
        for r in doc["runs"]:
            at = (r["scheme"], r.get("repeat", 0))
            if at in seen:
                raise ResultsError(f"{name}: {at[0]}'s repetition {at[1] + 1} is in {seen[at]} too "
                                   "(the later run needs --first-repeat)")
            seen[at] = name
            runs.append(r)
    runs.sort(key=lambda r: r.get("repeat", 0))  # stable: within a repetition, the order they ran
    provs = [doc.get("provenance") or {} for _, doc in documents]
    provenance = {k: "; ".join(str(p.get(k, "?")) for p in provs) for k in ("command", "commit", "started")}
    repeats = sorted({r.get("repeat", 0) for r in runs})
    options = {**first["options"], "repeat": len(repeats), "first_repeat": repeats[0]}
    rest = {k: v for k, v in first.items() if k not in ("options", "runs", "provenance", "summary", "source",
                                                        "schema", "reference", "tta_targets", "tta_rule", "partial")}
    return document("testbed", options, runs, provenance=provenance, reference=first.get("reference"),
                    merged_from=[name for name, _ in documents], **rest)


__all__ = ["CORE_METRICS", "SCHEMA", "SOURCES", "MERGE_FREE", "ResultsError", "by_scheme", "core_metrics", "document",
           "load", "merge", "repetitions", "schemes", "slim", "upgrade"]
