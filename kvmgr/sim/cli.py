"""``kvmgr simulate``: replay a request trace through the simulated serving loop.

Offers:
    add_arguments   the subcommand's flags
    run             run it (one simulation, or a capacity sweep with ``--sweep``); exit status

Without arguments it replays the bundled Mooncake FAST'25 conversation trace (12,031 requests)
with the ``tiny`` geometry: a 1M-token GPU cache, a 16M-token CPU tier, LRU, write-through.
Exit status: 0 on success, 1 when a loaded page failed its fingerprint check, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from kvmgr.errors import KVMgrError
from kvmgr.sim._flags import (
    DEFAULT_PLOT,
    add_simulate_flags,
    check_output_path,
    config_from_flags,
    trace_flag,
)
from kvmgr.sim._progress import progress_display as _progress
from kvmgr.sim.config import SimConfig
from kvmgr.sim.loop import simulate
from kvmgr.sim.multi_cli import (
    add_multi_arguments,
    check_multi_arguments,
    run_multi,
    wants_multi,
)
from kvmgr.sim.report import render_report
from kvmgr.sim.sweep import (
    gap_closed,
    plot_sweep,
    run_sweep,
    sweep_configs,
    sweep_table,
)
from kvmgr.sim.trace import default_trace_path, load_trace, slice_trace

__all__ = ["add_arguments", "check_output_path", "run"]

_DEFAULT_PLOT = DEFAULT_PLOT
_trace = trace_flag  # the --trace type (tests call it by this name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the flags of ``kvmgr simulate`` on ``parser``."""
    parser.description = (
        "Replay a request trace through a simulated serving loop (continuous batching, a GPU "
        "prefix cache, kvmgr's CPU tier) moving real page bytes and verifying every load."
    )
    add_simulate_flags(parser)
    add_multi_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run ``kvmgr simulate`` with parsed ``args``; returns the exit status."""
    console = Console()
    try:
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit: expected >= 1, got {args.limit}")
        if args.jobs < 1:
            raise ValueError(f"--jobs: expected >= 1, got {args.jobs}")
        if args.plot is not None and args.sweep is None:
            raise ValueError("--plot needs --sweep (a single run draws no plot)")
        check_output_path(args.json, "--json")  # fail now, not after the run
        check_multi_arguments(args)  # --instances, --disk, --shared: before loading the trace
        if args.sweep is not None:
            check_output_path(args.plot or _DEFAULT_PLOT, "--plot", image=True)
            if not any(p.strip() for p in args.sweep_policies.split(",")):
                raise ValueError(
                    f"--sweep-policies: expected one policy or more, got {args.sweep_policies!r}"
                )
        config = config_from_flags(args)
        trace = args.trace if args.trace is not None else default_trace_path()
        requests = slice_trace(load_trace(trace), args.offset, args.limit)
        if args.sweep is not None:
            return _run_sweep(args, config, requests, trace, console)
        if wants_multi(args):
            return run_multi(args, config, requests, trace, console)
        return _run_single(args, config, requests, trace, console)
    except (KVMgrError, ValueError, OSError) as exc:  # bad input: one line, no traceback
        print(f"kvmgr simulate: error: {exc}", file=sys.stderr)
        return 2


def _run_single(
    args: argparse.Namespace, config: SimConfig, requests: list[Any], trace: Path, console: Console
) -> int:
    with _progress(console, args.quiet) as progress:
        task = progress.add_task("requests", total=len(requests))
        report = simulate(
            config, requests, progress=lambda done, total: progress.update(task, completed=done)
        )
    console.print(render_report(report, title=f"kvmgr simulate: {trace.name}"))
    if args.json is not None:
        data = {"trace": str(trace), **report.to_dict()}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    return mismatch_status(report.page_mismatches)


def _run_sweep(
    args: argparse.Namespace, config: SimConfig, requests: list[Any], trace: Path, console: Console
) -> int:
    if not _has_matplotlib():  # fail before a long sweep, not after it
        print(
            "kvmgr simulate: --sweep needs matplotlib: pip install 'kvmgr[plot]'", file=sys.stderr
        )
        return 2
    policies = [p.strip() for p in args.sweep_policies.split(",") if p.strip()]
    configs = sweep_configs(config, args.sweep, policies)
    done = [0] * len(configs)  # requests done per run: the bar moves within runs

    def on_progress(index: int, num_done: int, _total: int) -> None:
        done[index] = num_done
        progress.update(task, completed=sum(done))

    with _progress(console, args.quiet) as progress:
        task = progress.add_task(
            f"requests of {len(configs)} runs ({args.jobs} at a time)",
            total=len(configs) * len(requests),
        )
        reports = run_sweep(configs, requests, jobs=args.jobs, on_progress=on_progress)
    console.print(sweep_table(reports, title=f"kvmgr simulate --sweep: {trace.name}"))
    if args.json is not None:  # before the plot, so a bad --plot path loses nothing
        data = {
            "trace": str(trace),
            "runs": [r.to_dict() for r in reports],
            "gap_closed": gap_closed(reports),  # per run: share of the LRU -> opt gap
        }
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    path = plot_sweep(
        reports, args.plot or _DEFAULT_PLOT, title=_sweep_title(config, requests, trace)
    )
    console.print(f"plot: {path}")
    return mismatch_status(sum(r.page_mismatches for r in reports))


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _sweep_title(config: SimConfig, requests: list[Any], trace: Path) -> str:
    gpu = config.gpu_tokens
    return (
        f"{trace.name}: {len(requests):,} requests, {config.model}, block "
        f"{config.block_size}, GPU {'unbounded' if gpu is None else f'{gpu / 1e6:g}M'} "
        f"tokens, write-{config.write_policy}"
    )


def mismatch_status(num_mismatches: int) -> int:
    """The exit status of a run: 1 (with a line on stderr) when loaded pages failed their
    fingerprint check, else 0."""
    if num_mismatches:
        print(
            f"kvmgr simulate: error: {num_mismatches} loaded pages failed their fingerprint check",
            file=sys.stderr,
        )
        return 1
    return 0
