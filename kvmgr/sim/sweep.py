"""Capacity sweeps: hit ratio against CPU-tier capacity, per eviction policy, with a plot.

Offers:
    DEFAULT_SWEEP_TOKENS  the CPU capacities of ``kvmgr simulate --sweep`` without a list
    sweep_configs         the run configurations of a sweep (policy-major order)
    run_sweep             run them, in worker processes when ``jobs > 1``
    sweep_table           the rich table of a sweep (with the LRU -> opt gap closed)
    gap_closed            the share of the LRU -> opt gap each run closes
    plot_sweep            the PNG: hit ratio (GPU + CPU, CPU part dashed) vs capacity

Runs are independent and deterministic, so running them in parallel changes nothing but the
wall time. Worker processes are spawned (not forked), so no thread of the parent is copied.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import multiprocessing
import queue as _queue
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.table import Table

from kvmgr.sim.config import SimConfig
from kvmgr.sim.loop import simulate
from kvmgr.sim.report import SimReport
from kvmgr.sim.trace import TraceRequest

__all__ = [
    "DEFAULT_SWEEP_TOKENS",
    "gap_closed",
    "plot_sweep",
    "run_sweep",
    "sweep_configs",
    "sweep_table",
]

#: CPU capacities (tokens) of the default sweep: 1M to 100M, with the paper's 3M and 50M.
DEFAULT_SWEEP_TOKENS = (
    1_000_000,
    3_000_000,
    6_000_000,
    12_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
)


def sweep_configs(
    base: SimConfig, cpu_tokens: Sequence[int], policies: Sequence[str]
) -> list[SimConfig]:
    """One config per (policy, capacity), policy-major, everything else as in ``base``."""
    return [attrs.evolve(base, policy=p, cpu_tokens=c) for p in policies for c in cpu_tokens]


def _run_one(
    config: SimConfig, requests: Sequence[TraceRequest], index: int = 0, queue: Any = None
) -> SimReport:
    """One run; with ``queue``, its progress is put there as ``(index, done, total)``."""
    progress = None if queue is None else lambda done, total: queue.put((index, done, total))
    return simulate(config, requests, progress=progress)


#: seconds between looks at the workers' progress queue
_POLL_S = 0.5


def run_sweep(
    configs: Sequence[SimConfig],
    requests: Sequence[TraceRequest],
    *,
    jobs: int = 1,
    on_done: Callable[[int, SimReport], None] | None = None,
    on_progress: Callable[[int, int, int], None] | None = None,
) -> list[SimReport]:
    """Run every config over ``requests``; reports come back in the order of ``configs``.

    Args:
        configs: the runs.
        requests: the trace.
        jobs: worker processes (1: run here, one after the other).
        on_done: called with (index, report) as each run finishes.
        on_progress: called with (index, requests done, requests) while each run goes on
            (every few hundred steps; from worker processes through a queue, read about every
            0.5 s), so a caller can show progress within runs, not only between them.

    Raises:
        ValueError: ``jobs`` < 1.
        Whatever a run raises (``ConfigError``, ``TransferError``).
    """
    if jobs < 1:
        raise ValueError(f"expected jobs >= 1, got {jobs}")
    reports: list[SimReport | None] = [None] * len(configs)

    def done(i: int, report: SimReport) -> None:
        reports[i] = report
        if on_done is not None:
            on_done(i, report)

    if jobs == 1:
        for i, config in enumerate(configs):
            progress = None if on_progress is None else functools.partial(on_progress, i)
            done(i, simulate(config, requests, progress=progress))
    else:
        _run_in_processes(configs, requests, jobs, done, on_progress)
    return [r for r in reports if r is not None]


def _run_in_processes(
    configs: Sequence[SimConfig],
    requests: Sequence[TraceRequest],
    jobs: int,
    done: Callable[[int, SimReport], None],
    on_progress: Callable[[int, int, int], None] | None,
) -> None:
    """``run_sweep`` over ``jobs`` spawned worker processes (progress through a queue)."""
    context = multiprocessing.get_context("spawn")
    with contextlib.ExitStack() as stack:
        queue = None
        if on_progress is not None:
            queue = stack.enter_context(context.Manager()).Queue()
        pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context))
        futures = {
            pool.submit(_run_one, c, list(requests), i, queue): i for i, c in enumerate(configs)
        }
        pending: set[concurrent.futures.Future[SimReport]] = set(futures)
        while pending:
            finished, pending = concurrent.futures.wait(
                pending, timeout=_POLL_S, return_when=concurrent.futures.FIRST_COMPLETED
            )
            _drain(queue, on_progress)
            for future in finished:
                done(futures[future], future.result())


def _drain(queue: Any, on_progress: Callable[[int, int, int], None] | None) -> None:
    """Hand every progress record waiting in ``queue`` to ``on_progress``."""
    if queue is None or on_progress is None:
        return
    while True:
        try:
            index, done, total = queue.get_nowait()
        except _queue.Empty:
            return
        on_progress(index, done, total)


def _tokens(n: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:g}"


def sweep_table(reports: Sequence[SimReport], title: str = "capacity sweep") -> Table:
    """Hit ratios per (policy, CPU capacity)."""
    table = Table(title=title, title_justify="left")
    for name in (
        "policy",
        "CPU tokens",
        "hit",
        "GPU hit",
        "CPU hit",
        "CPU evictions",
        "GiB D2H",
        "GiB H2D",
        "gap closed",
    ):
        table.add_column(name, justify="left" if name == "policy" else "right")
    closed = gap_closed(reports)
    for r, gap in zip(reports, closed):
        s = r.settings
        table.add_row(
            s["policy"],
            _tokens(s["cpu_blocks"] * s["block_size"]),
            f"{r.hit_ratio:.2%}",
            f"{r.gpu_hit_ratio:.2%}",
            f"{r.cpu_hit_ratio:.2%}",
            _tokens(r.cpu_evictions),
            f"{r.d2h['bytes'] / 2**30:.2f}",
            f"{r.h2d['bytes'] / 2**30:.2f}",
            "" if gap is None else f"{gap:+.0%}",
        )
    if reports:
        table.caption = f"trace reuse ceiling (infinite cache): {reports[0].ceiling_ratio:.2%}"
    return table


def gap_closed(reports: Sequence[SimReport]) -> list[float | None]:
    """Per report, ``(hit - LRU hit) / (opt hit - LRU hit)`` at its CPU capacity: the share of
    the LRU -> offline-optimum gap it closes (negative: worse than LRU); ``None`` where the
    sweep lacks ``lru`` or ``opt`` at that capacity, or the gap is under 0.01 points."""
    by = {(r.settings["policy"], r.settings["cpu_blocks"]): r.hit_ratio for r in reports}
    out: list[float | None] = []
    for r in reports:
        blocks = r.settings["cpu_blocks"]
        lru, opt = by.get(("lru", blocks)), by.get(("opt", blocks))
        if lru is None or opt is None or opt - lru < 1e-4:
            out.append(None)
        else:
            out.append((r.hit_ratio - lru) / (opt - lru))
    return out


def plot_sweep(reports: Sequence[SimReport], path: str | Path, *, title: str) -> Path:
    """Write a PNG of hit ratio vs CPU capacity (log scale), one line per policy (the CPU-hit
    part dashed when at most two online policies are shown), the offline optimum ``opt`` in
    black, the trace's reuse ceiling as a horizontal line. Needs matplotlib.

    Raises:
        ImportError: matplotlib is not installed (``pip install kvmgr[plot]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    policies = list(dict.fromkeys(r.settings["policy"] for r in reports))
    with_cpu = len([p for p in policies if p != "opt"]) <= 2
    for n, policy in enumerate(policies):
        runs = sorted(
            (r for r in reports if r.settings["policy"] == policy),
            key=lambda r: r.settings["cpu_blocks"],
        )
        _plot_policy(ax, policy, runs, f"C{n}", with_cpu=with_cpu)
    _decorate(ax, reports, title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out


def _plot_policy(
    ax: Any, policy: str, runs: list[SimReport], color: str, *, with_cpu: bool
) -> None:
    """One policy's line (``opt``: black triangles), and its CPU-hit part when ``with_cpu``."""
    xs = [r.settings["cpu_blocks"] * r.settings["block_size"] / 1e6 for r in runs]
    hits = [100 * r.hit_ratio for r in runs]
    if policy == "opt":
        ax.plot(xs, hits, "k^--", label="opt (offline optimum): GPU + CPU hits")
        return
    ax.plot(xs, hits, "o-", color=color, label=f"{policy}: GPU + CPU hits")
    if with_cpu:
        cpu_hits = [100 * r.cpu_hit_ratio for r in runs]
        ax.plot(xs, cpu_hits, "s--", color=color, alpha=0.6, label=f"{policy}: CPU hits")


def _decorate(ax: Any, reports: Sequence[SimReport], title: str) -> None:
    """The ceiling line, the axes (log capacity in tokens), the title, grid and legend."""
    if reports:
        ceiling = 100 * reports[0].ceiling_ratio
        ax.axhline(
            ceiling, color="grey", linestyle=":", label=f"trace reuse ceiling {ceiling:.1f}%"
        )
        gpu = reports[0].settings["gpu_blocks"] * reports[0].settings["block_size"]
        ax.set_xlabel(f"CPU tier capacity (million tokens; GPU cache {gpu / 1e6:.1f}M tokens)")
    ax.set_xscale("log")
    ticks = sorted({r.settings["cpu_blocks"] * r.settings["block_size"] / 1e6 for r in reports})
    ax.set_xticks(ticks, [_tokens(t * 1e6) for t in ticks])
    ax.minorticks_off()
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
