"""The figures of a ``dlcp converge`` study: final accuracy against the bound, and accuracy
against training time (time-to-accuracy). Matplotlib's Agg backend: no display needed."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Sequence

from dlcp.topologies.converge import Grid, Settings, Summary, config_of, mean_trace


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(settings: Settings, grid: Grid, summaries: Sequence[Summary]) -> str:
    loss = "loss injected = p" if grid.losses is None else "loss injected"
    ns = sorted({s.accuracy.n for s in summaries}) or [0]
    seeds = f"{ns[0]}" if ns[0] == ns[-1] else f"{ns[0]}-{ns[-1]}"
    return (f"{settings.workload}, {settings.workers} workers on loopback, {settings.steps} steps, "
            f"{seeds} seeds per configuration\n{loss} on drop classes 1-3")


def plot_accuracy_vs_bound(path: Path, summaries: Sequence[Summary], rows: Sequence[dict], settings: Settings,
                           grid: Grid) -> None:
    """Mean final accuracy (bars: 95 % interval; dots: seeds) against the bound, one line per
    pattern, error feedback and injected loss. Lossless training starts every line at p = 0
    (error feedback has nothing to carry there)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    series: dict[tuple, list[Summary]] = {}
    for s in summaries:
        c = s.config
        reliable = grid.reliable and c.bound == 0 and c.loss > 0  # a point of its own at p = 0
        loss = c.loss if grid.losses is not None or reliable else -1.0
        for ef in (grid.error_feedback if c.lossless else (c.error_feedback,)):
            series.setdefault((c.pattern, reliable, ef, loss), []).append(s)
    series = {k: v for k, v in series.items() if not (k[2] and all(p.config.lossless for p in v))}
    width = max(grid.bounds) or 1.0
    for i, ((pattern, reliable, ef, loss), pts) in enumerate(sorted(series.items())):
        pts = sorted(pts, key=lambda s: s.config.bound)
        dx = (i - (len(series) - 1) / 2) * 0.012 * width
        x = [s.config.bound + dx for s in pts]
        y = [100 * s.accuracy.mean for s in pts]
        err = [[100 * (s.accuracy.mean - s.accuracy.low) if s.accuracy.low is not None else 0 for s in pts],
               [100 * (s.accuracy.high - s.accuracy.mean) if s.accuracy.high is not None else 0 for s in pts]]
        label = pts[0].config.label if reliable else (
            f"{pattern}{', EF' if ef else ''}" + ("" if loss < 0 else f", loss {loss:.0%}"))
        line = ax.errorbar(x, y, yerr=err, marker="s" if reliable else "o", capsize=4, label=label)
        for s, xx in zip(pts, x):
            accs = [100 * r["accuracy"] for r in rows if config_of(r) == s.config]
            ax.scatter([xx] * len(accs), accs, s=10, alpha=0.35, color=line[0].get_color())
    ax.set_xlabel("loss bound p of gradient pushes")
    ax.set_ylabel("final test accuracy (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(_title(settings, grid, summaries) + "; mean, bars: 95 % t interval, dots: seeds", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accuracy_vs_time(path: Path, summaries: Sequence[Summary], rows: Sequence[dict], settings: Settings,
                          grid: Grid) -> None:
    """Test accuracy against training time (top) and against steps (bottom), one column per
    pattern: thin lines are seeds, thick their mean; the dashed line is the target (lossless
    mean - 0.5 points). Time is what a user waits for, but on a shared machine it also carries
    the machine's load; steps show the convergence the gradients alone allow."""
    plt = _pyplot()
    patterns = list(dict.fromkeys(s.config.pattern for s in summaries))
    fig, axes = plt.subplots(2, len(patterns), figsize=(6.5 * len(patterns), 8.5), squeeze=False)
    lo = min((100 * s.accuracy.mean for s in summaries), default=0)
    for col, pattern in enumerate(patterns):
        top, bottom = axes[0][col], axes[1][col]
        for s in (s for s in summaries if s.config.pattern == pattern):
            traces = [r["trace"] for r in rows if config_of(r) == s.config and r["trace"]]
            if not traces:
                continue
            mt = mean_trace(traces)
            style = {"color": "black", "zorder": 3} if s.config.lossless else {}
            line, = top.plot([t for t, _, _ in mt], [100 * a for _, _, a in mt], lw=2, label=s.config.label, **style)
            bottom.plot([k for _, k, _ in mt], [100 * a for _, _, a in mt], lw=2, **(style or
                                                                                {"color": line.get_color()}))
            for tr in traces:
                top.plot([p[0] for p in tr], [100 * p[2] for p in tr], lw=0.6, alpha=0.3, color=line.get_color())
            if s.config.lossless and s.target is not None:
                for ax in (top, bottom):
                    ax.axhline(100 * s.target, color="grey", ls="--", lw=0.8)
        top.set_xlabel("training time, s (worker 0, evaluations left out)")
        bottom.set_xlabel("step")
        top.legend(fontsize=8, loc="lower right")
        top.set_ylim(max(0.0, lo - 25), 100)
        bottom.set_ylim(max(0.0, lo - 10), min(100.0, lo + 4))
        bottom.set_xlim(0.3 * settings.steps, settings.steps)
        for ax in (top, bottom):
            ax.set_ylabel("test accuracy (%)")
            ax.grid(alpha=0.3)
        bottom.set_title(f"{pattern}: the last part against steps (means over seeds)", fontsize=8)
    fig.suptitle(_title(settings, grid, summaries) + "; dashed: lossless mean - 0.5 points", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
