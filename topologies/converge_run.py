"""Running a ``dlcp converge`` study: each run is the workload's workers in a child process
tree (``python -m dlcp_torch.workloads <workload>``), one after the other by default; rows go
into the study's CSV as runs finish, and the table and plots are written from it at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING

from dlcp.hostagent.clikit import number, numbers
from dlcp.hostagent.errors import DlcpUserError
from dlcp.topologies.converge import (RANGES, Config, Grid, Settings, Summary, append_row, key_of, markdown_table,
                                      read_rows, row_of, rows_for, run_key, summarise)
from dlcp.topologies.converge_plot import plot_accuracy_vs_bound, plot_accuracy_vs_time
from dlcp.topologies.progress import eta

if TYPE_CHECKING:  # torch is imported when a study starts, not when the command line is built
    from dlcp_torch.workloads.base import Workload

#: What ``dlcp converge`` needs beyond the workload (module -> the extra that installs it): the
#: plots, and the intervals over seeds.
REPORT_MODULES = {"matplotlib": "converge", "scipy": "converge"}


def max_jobs(workers: int, cpus: int | None = None) -> int:
    """Runs at once that this machine can take: each run's workers need a core each, or the
    measured times are contention (at least one run, however small the machine)."""
    return max(1, (cpus or os.cpu_count() or 1) // workers)


def check_workload(workload: str) -> Workload:
    """The :class:`~dlcp_torch.workloads.base.Workload` called ``workload``, checked to be
    trainable here (torch and its optional packages installed), so a study fails before its
    first run rather than in it."""
    if importlib.util.find_spec("torch") is None:
        raise DlcpUserError("dlcp converge trains with PyTorch, which is not installed; install it with: "
                            "pip install 'dlcp[torch]' (for the CPU build, pip install torch==2.13.0 first)")
    from dlcp_torch.workloads import get_workload
    from dlcp_torch.workloads.base import MissingDependency

    try:
        w = get_workload(workload)
        if w.prerequisite is not None:
            w.prerequisite()
    except (ValueError, MissingDependency) as exc:
        raise DlcpUserError(str(exc)) from None
    return w


def check_report() -> None:
    """Raises :class:`DlcpUserError` naming the extra when what writes the report is missing, so
    a study does not train every run and then fail at its plots."""
    missing = sorted(m for m in REPORT_MODULES if importlib.util.find_spec(m) is None)
    if missing:
        extras = sorted({REPORT_MODULES[m] for m in missing})
        raise DlcpUserError(f"dlcp converge's report needs {', '.join(missing)}; install it with: "
                            f"pip install 'dlcp[{','.join(extras)}]'")


def run_one(settings: Settings, config: Config, seed: int, out: Path, timeout: float) -> list[dict]:
    """One run: the workload's workers as a child process tree, its log under ``out/logs``."""
    check_workload(settings.workload)
    name = (f"{config.pattern}-p{config.bound:g}-loss{config.loss:g}{'-ef' if config.error_feedback else ''}"
            f"-seed{seed}")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    result = out / "logs" / f"{name}.json"
    result.unlink(missing_ok=True)  # a failed attempt's leftovers are never read as this run's
    cmd = [sys.executable, "-m", "dlcp_torch.workloads", settings.workload, "--workers", str(settings.workers),
           "--pattern", config.pattern, "--mode", settings.mode, "--steps", str(settings.steps),
           "--loss", str(config.loss), "--bound", str(config.bound), "--seed", str(seed),
           "--eval-every", str(settings.eval_every),
           "--timeout", str(timeout), "--json", str(result)] + (["--error-feedback"] if config.error_feedback else [])
    with open(out / "logs" / f"{name}.log", "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout + 60, check=False)
        except subprocess.TimeoutExpired:
            raise DlcpUserError(f"run {name} did not finish within {timeout + 60:g} s (log: {log.name})") from None
    if proc.returncode != 0:
        raise DlcpUserError(f"run {name} failed with exit code {proc.returncode} (log: {out / 'logs' / name}.log)")
    return json.loads(result.read_text())


def study(settings: Settings, grid: Grid, out: Path, jobs: int = 1, timeout: float = 900.0,
          progress: Callable[[str], None] = print) -> tuple[list[Summary], list[str]]:
    """Run every run of ``grid`` not yet in ``out/converge.csv``, then write the table and plots.

    Returns the summaries and the failures (one line each; a failed run has no row, so the
    next call retries it).
    """
    if not 1 <= jobs <= max_jobs(settings.workers):
        raise DlcpUserError(f"--jobs {jobs}: at most {max_jobs(settings.workers)} run(s) of {settings.workers} "
                            f"workers at once on {os.cpu_count()} CPUs")
    check_workload(settings.workload)  # fails now, not after the first run, when it cannot train
    check_report()
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "converge.csv"
    done = {run_key(r) for r in read_rows(csv_path)}
    todo = [(c, s) for c, s in grid.runs() if key_of(settings, c, s) not in done]
    total = len(grid.runs())
    progress(f"{total - len(todo)} of {total} runs already in {csv_path}; {len(todo)} to run")
    failures: list[str] = []
    started = time.monotonic()

    def finish(i: int, c: Config, s: int, attempted: tuple[list[dict] | Exception, float]) -> None:
        results, wall = attempted
        left = eta(time.monotonic() - started, i, len(todo))
        if isinstance(results, Exception):
            failures.append(str(results))
            progress(f"[{i}/{len(todo)}] {c.label}, seed {s}: FAILED after {wall:.0f} s: {results}{left}")
            return
        row = row_of(settings, c, s, results)
        append_row(csv_path, row)
        progress(f"[{i}/{len(todo)}] {c.label}, seed {s}: accuracy {row['accuracy']:.4f}, "
                 f"run {wall:.0f} s (training {row['train_s']:.1f} s), lost {row['lost_mean']:.1%}{left}")

    def attempt(c: Config, s: int) -> tuple[list[dict] | Exception, float]:
        t0 = time.monotonic()
        try:
            return run_one(settings, c, s, out, timeout), time.monotonic() - t0
        except DlcpUserError as exc:
            return exc, time.monotonic() - t0

    if jobs == 1:
        for i, (c, s) in enumerate(todo, 1):
            finish(i, c, s, attempt(c, s))
    else:
        from concurrent.futures import ThreadPoolExecutor, as_completed

        with ThreadPoolExecutor(jobs) as pool:
            futures = {pool.submit(attempt, c, s): (c, s) for c, s in todo}
            for i, fut in enumerate(as_completed(futures), 1):
                finish(i, *futures[fut], fut.result())
    return report(out, settings, grid), failures


def report(out: Path, settings: Settings, grid: Grid) -> list[Summary]:
    """converge.md and the two plots from the rows of this study in ``out/converge.csv``."""
    rows = rows_for(read_rows(out / "converge.csv"), settings, grid)
    summaries = summarise(rows, settings, grid)
    if summaries:
        (out / "converge.md").write_text(markdown_table(summaries))
        plot_accuracy_vs_bound(out / "accuracy-vs-bound.png", summaries, rows, settings, grid)
        plot_accuracy_vs_time(out / "accuracy-vs-time.png", summaries, rows, settings, grid)
    return summaries


def cmd_converge(args: argparse.Namespace) -> int:
    """``dlcp converge``: run the study the options describe, print its table."""
    from dlcp.topologies import converge as cv

    steps = args.steps or check_workload(args.workload).steps
    settings = cv.Settings(workload=args.workload, workers=args.workers, steps=steps,
                           eval_every=args.eval_every or max(1, steps // 20), mode=args.mode)
    grid = cv.Grid(seeds=tuple(range(args.first_seed, args.first_seed + args.seeds)),
                   bounds=args.bounds, losses=None if args.losses == "same" else args.losses,
                   error_feedback=cv.parse_switches(args.error_feedback, "--error-feedback"),
                   patterns=tuple(p.strip() for p in args.patterns.split(",")), reliable=args.reliable)
    out = Path(args.out)
    summaries, failures = study(settings, grid, out, jobs=args.jobs, timeout=args.timeout,
                                progress=lambda text: print(text, file=sys.stderr, flush=True))
    print(cv.markdown_table(summaries), end="")
    print(f"study directory: {out} (converge.csv, converge.md, accuracy-vs-bound.png, accuracy-vs-time.png, logs/)")
    if failures:
        print(f"dlcp: error: {len(failures)} run(s) failed (first: {failures[0]}); the same command retries them",
              file=sys.stderr)
        return 1
    return 0


def _losses(text: str) -> str | tuple[float, ...]:
    """``--losses``: ``same`` or drop probabilities, each checked as it is parsed."""
    return text if text == "same" else numbers(RANGES["losses"])(text)


def add_converge_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``dlcp converge`` (registered by :mod:`dlcp.topologies.commands`)."""
    p.add_argument("--workload", choices=["mnist1d", "digits"], default="mnist1d",
                   help="the workload to train (mnist1d needs: pip install 'dlcp[mnist1d]')")
    p.add_argument("--workers", type=number(RANGES["workers"]), default=4)
    p.add_argument("--steps", type=number(RANGES["steps"]), default=None,
                   help="steps per run (default: the workload's)")
    p.add_argument("--eval-every", type=number(RANGES["eval_every"]), default=None,
                   help="steps between test evaluations for time-to-accuracy (default: steps / 20)")
    p.add_argument("--mode", choices=["ddp", "optimizer"], default="ddp")
    p.add_argument("--seeds", type=number(RANGES["seeds"]), default=5, help="seeds per configuration (default 5)")
    p.add_argument("--first-seed", type=number(RANGES["first_seed"]), default=0)
    p.add_argument("--bounds", type=numbers(RANGES["bounds"]), default=(0.0, 0.1, 0.2),
                   help="loss bounds p, comma-separated (default 0,0.1,0.2)")
    p.add_argument("--losses", type=_losses, default="same",
                   help="injected drop probabilities of drop classes 1-3, crossed with the bounds; "
                        "same (default): each bound with a loss equal to it")
    p.add_argument("--reliable", action="store_true",
                   help="also each nonzero bound's loss with p = 0 (recovered in full): the time baseline")
    p.add_argument("--error-feedback", default="off,on", help="off, on or off,on (default)")
    p.add_argument("--patterns", default="ps,ring", help="ps, ring or ps,ring (default)")
    p.add_argument("--jobs", type=number(RANGES["jobs"]), default=1,
                   help="runs at once (default 1; at most one per --workers cores of this machine)")
    p.add_argument("--timeout", type=number(RANGES["timeout"], float), default=900.0,
                   help="seconds one run may take")
    p.add_argument("--out", default="runs/converge",
                   help="study directory; runs already in its converge.csv are skipped (default runs/converge)")
