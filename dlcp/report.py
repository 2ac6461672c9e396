"""``dlcp report``: any kept result as the Markdown a results page shows, in the order given.

One reader for every kind of result: a run's results.json, testbed's or simulator's (one
schema, :mod:`dlcp.topologies.results`), a sweep's sweep.csv (testbed's or simulator's, one table
writer, :func:`dlcp.topologies.sweepkit.markdown`), a convergence study's converge.csv and a
benchmark's tables file (:mod:`dlcp.hostagent.tables`). It lives in the program's package because it
reads what every layer below writes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dlcp_sim import report as sim_report
from dlcp_sim.sweep import markdown as sim_sweep_markdown
from dlcp.hostagent import tables
from dlcp.hostagent.errors import DlcpUserError, UsageError
from dlcp.hostagent.provenance import results_file, write_slim
from dlcp.topologies import converge
from dlcp.topologies import results_table as testbed_report
from dlcp.topologies.report import against
from dlcp.topologies.results import ResultsError, merge, upgrade
from dlcp.topologies.sweep import markdown as testbed_sweep_markdown
from dlcp.topologies.sweepkit import read_csv, sweep_csv


def add_report_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add report to ``dlcp``'s sub-commands."""
    p = sub.add_parser("report", help="results as Markdown tables for a results page: runs' results.json (testbed "
                       "and simulator), sweeps' sweep.csv, convergence studies' converge.csv, benchmarks' tables files")
    p.add_argument("results", nargs="+", metavar="RESULTS",
                   help="results files, in the order their sections are printed: results.json (or a run "
                        "directory), sweep.csv or converge.csv (or the study's directory), a benchmark's --out file")
    p.add_argument("--slim", metavar="DIR", default=None,
                   help="also write each run's results without its per-iteration records to DIR/<run>.json: "
                        "small enough to keep beside a results page, and enough to regenerate its tables")
    p.add_argument("--against", metavar="SCHEME", default=None,
                   help="pair the speedups with this scheme instead of the run's reference (the accuracy target "
                        "stays the run's)")
    p.add_argument("--merge", action="store_true",
                   help="the testbed runs given are repetitions of one experiment (the later ones run with "
                        "dlcp run --first-repeat): one section pairing them all")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    """Print each file's section in the order given, so a page's sections come out in its order
    (with ``--merge``, one section of them all)."""
    if args.merge:
        print(merged_section(args.results, slim_dir=args.slim, against_scheme=args.against))
        return 0
    for given in args.results:
        print(section(given, slim_dir=args.slim, against_scheme=args.against))
    return 0


def section(given: str, slim_dir: str | None = None, against_scheme: str | None = None) -> str:
    """The Markdown of one results file a command line names.

    Raises:
        UsageError: it is none of the files above, or ``against_scheme`` did not run in it.
    """
    if sweep_csv(given) is not None:
        return _csv_section(given)
    path = results_file(given)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{given}: not a run's results ({exc})") from None
    if tables.is_tables(raw):  # a benchmark's
        return tables.markdown(raw, str(given))
    try:
        results = upgrade(raw)
    except ResultsError as exc:
        raise UsageError(f"{given}: {exc}") from None
    source = str(given)
    try:
        if sim_report.is_sim_results(results):
            if slim_dir:
                source = write_slim(slim_dir, path, sim_report.slim(results))
            return sim_report.markdown(results, source, against_scheme)
        results = testbed_report.refresh_metrics(results)
        if slim_dir:
            source = write_slim(slim_dir, path, testbed_report.slim(results))
        if against_scheme:
            results = against(results, against_scheme)
        return testbed_report.markdown(results, source)
    except ValueError as exc:
        raise UsageError(f"--against: {exc}") from None


def merged_section(given: list[str], slim_dir: str | None = None, against_scheme: str | None = None) -> str:
    """The Markdown of testbed runs that are repetitions of one experiment, paired as one run
    (:func:`dlcp.topologies.results.merge`); each is kept slim on its own with ``slim_dir``.

    Raises:
        UsageError: a file is not a testbed run's results, or they are not one experiment's.
    """
    documents, sources = [], []
    for name in given:
        path = results_file(name)
        try:
            results = testbed_report.refresh_metrics(upgrade(json.loads(path.read_text())))
        except (OSError, ValueError) as exc:  # (ResultsError is a ValueError)
            raise UsageError(f"{name}: not a run's results ({exc})") from None
        if results.get("source") != "testbed":
            raise UsageError(f"{name}: --merge joins testbed runs; this is the {results.get('source')}'s")
        sources.append(write_slim(slim_dir, path, testbed_report.slim(results)) if slim_dir else str(name))
        documents.append((str(name), results))
    try:
        results = merge(documents)
        if against_scheme:
            results = against(results, against_scheme)
    except ResultsError as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:
        raise UsageError(f"--against: {exc}") from None
    return testbed_report.markdown(results, ", ".join(sources))


def _csv_section(given: str) -> str:
    """A sweep's table (testbed's rows count runs, the simulator's seeds) or a convergence study's."""
    path = sweep_csv(given)
    assert path is not None
    try:
        rows = read_csv(path)
    except ValueError:
        return _converge_section(given, path)
    except OSError as exc:
        raise UsageError(f"{given}: {exc}") from None
    param = str(rows[0]["param"])
    if "seeds" in rows[0]:
        return f"Sweep from `{given}`:\n\n{sim_sweep_markdown(rows, param)}"
    if "runs" in rows[0]:
        return f"Sweep from `{given}`:\n\n{testbed_sweep_markdown(rows, param)}"
    raise UsageError(f"{given}: a sweep's CSV with neither the testbed's columns (runs, valid_runs) nor the "
                     "simulator's (seeds)")


def _converge_section(given: str, path: Path) -> str:
    """Each study in a converge.csv: what it trained, then its table (``converge.md``'s)."""
    try:
        studies = converge.studies_in(converge.read_rows(path))
    except DlcpUserError:
        raise UsageError(f"{given}: neither a sweep's CSV nor a convergence study's") from None
    parts = []
    for s, summaries in studies:
        parts.append(f"**Study**: {s.workload}, {s.workers} workers, {s.steps} steps ({s.mode}), test accuracy every "
                     f"{s.eval_every} steps; from `{given}`.\n\n{converge.markdown_table(summaries)}")
    return "\n".join(parts)


__all__ = ["add_report_command", "cmd_report", "merged_section", "section"]
