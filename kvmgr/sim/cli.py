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
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from kvmgr.errors import KVMgrError
from kvmgr.policy import POLICIES
from kvmgr.sim._counts import count, count_list
from kvmgr.sim._progress import progress_display as _progress
from kvmgr.sim.loop import SimConfig, simulate
from kvmgr.sim.multi_cli import (
    add_multi_arguments,
    check_multi_arguments,
    run_multi,
    wants_multi,
)
from kvmgr.sim.presets import MODEL_PRESETS
from kvmgr.sim.report import render_report
from kvmgr.sim.scheduler import WRITE_POLICIES
from kvmgr.sim.sweep import (
    DEFAULT_SWEEP_TOKENS,
    plot_sweep,
    run_sweep,
    sweep_configs,
    sweep_table,
)
from kvmgr.sim.trace import BUNDLED_TRACES, bundled_trace_path, default_trace_path, load_trace

__all__ = ["add_arguments", "run"]

_DEFAULT_PLOT = Path("kvmgr-sweep.png")


def _trace(text: str) -> Path:
    """A bundled trace's name (``azure-code``) -> its path; anything else is a file path."""
    return bundled_trace_path(text) if text in BUNDLED_TRACES else Path(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the flags of ``kvmgr simulate`` on ``parser``."""
    d = SimConfig()
    parser.description = (
        "Replay a request trace through a simulated serving loop (continuous batching, a GPU "
        "prefix cache, kvmgr's CPU tier) moving real page bytes and verifying every load."
    )
    io = parser.add_argument_group("input and output")
    io.add_argument(
        "--trace",
        type=_trace,
        default=None,
        metavar="FILE|NAME",
        help="Mooncake JSONL or Azure 2023 CSV file (.gz ok), or a bundled trace: "
        f"{', '.join(BUNDLED_TRACES)}; default: the bundled Mooncake conversation trace",
    )
    io.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    io.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the report (or the sweep) as JSON",
    )
    io.add_argument("--quiet", action="store_true", help="no progress bar")
    cap = parser.add_argument_group("capacities (K/M/G suffixes are decimal; 'inf' = unbounded)")
    gpu = cap.add_mutually_exclusive_group()
    gpu.add_argument(
        "--gpu-tokens",
        type=count,
        default=d.gpu_tokens,
        help=f"GPU prefix-cache capacity in tokens (default {d.gpu_tokens:,})",
    )
    gpu.add_argument("--gpu-blocks", type=count, default=None, help="... or in blocks")
    cpu = cap.add_mutually_exclusive_group()
    cpu.add_argument(
        "--cpu-tokens",
        type=count,
        default=d.cpu_tokens,
        help=f"CPU tier capacity in tokens (default {d.cpu_tokens:,})",
    )
    cpu.add_argument("--cpu-blocks", type=count, default=None, help="... or in blocks")
    m = parser.add_argument_group("model and manager")
    m.add_argument(
        "--model",
        choices=list(MODEL_PRESETS),
        default=d.model,
        help="KV geometry preset (page bytes); default tiny",
    )
    m.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help=f"tokens per block, dividing 512 (default {d.block_size})",
    )
    m.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default=d.policy,
        help="CPU eviction policy; opt = the offline optimum (knows the trace's future)",
    )
    m.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        default=d.write_policy,
        help="store prefix blocks when filled (through) or when evicted (evict)",
    )
    m.add_argument(
        "--fail-rate",
        type=float,
        default=0.0,
        help="fail this fraction of store batches on purpose (fault-injection soak)",
    )
    m.add_argument(
        "--engine",
        choices=("auto", "host", "cuda", "kernel"),
        default=d.engine,
        help="transfer engine (auto: host without a GPU)",
    )
    m.add_argument("--seed", type=int, default=d.seed, help="seeds the page fingerprints")
    m.add_argument(
        "--max-memory-gib",
        type=float,
        default=d.max_memory_bytes / 2**30,
        help="refuse runs whose GPU + CPU pages exceed this",
    )
    s = parser.add_argument_group("scheduler and cost model")
    s.add_argument(
        "--time-scale",
        type=float,
        default=d.time_scale,
        help="multiply arrival times (< 1 compresses the trace)",
    )
    s.add_argument(
        "--max-batched-tokens",
        type=int,
        default=d.max_batched_tokens,
        help="token budget of one scheduler step (prefill + decode)",
    )
    s.add_argument(
        "--max-seqs", type=int, default=d.max_seqs, help="requests running at once, at most"
    )
    s.add_argument(
        "--watermark",
        type=float,
        default=d.watermark,
        help="fraction of GPU blocks kept free when admitting",
    )
    s.add_argument("--step-ms", type=float, default=d.step_ms, help="fixed cost of a step")
    s.add_argument(
        "--tokens-per-s",
        type=float,
        default=d.tokens_per_s,
        help="compute throughput of the virtual GPU",
    )
    s.add_argument(
        "--h2d-gbps",
        type=float,
        default=d.h2d_gbps,
        help="CPU->GPU bandwidth charged for loads (GB/s), per rank",
    )
    s.add_argument(
        "--tp",
        type=int,
        default=d.tp,
        help="tensor-parallel ranks: each moves 1/N of the loaded bytes in parallel",
    )
    w = parser.add_argument_group("capacity sweep")
    w.add_argument(
        "--sweep",
        nargs="?",
        type=count_list,
        const=list(DEFAULT_SWEEP_TOKENS),
        default=None,
        metavar="TOKENS",
        help="run these CPU capacities (default 1M,3M,6M,12M,25M,50M,100M)",
    )
    w.add_argument(
        "--sweep-policies",
        default="lru,arc,s3fifo,reuse,opt",
        help="policies of the sweep (opt: the offline optimum, the bound)",
    )
    w.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"with --sweep: image of the sweep (default {_DEFAULT_PLOT})",
    )
    w.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="sweep runs in parallel processes",
    )

    add_multi_arguments(parser)


def _config(args: argparse.Namespace) -> SimConfig:
    bs = args.block_size
    gpu = args.gpu_tokens if args.gpu_blocks is None else args.gpu_blocks * bs
    cpu = args.cpu_tokens if args.cpu_blocks is None else args.cpu_blocks * bs
    return SimConfig(
        model=args.model,
        block_size=bs,
        gpu_tokens=gpu,
        cpu_tokens=cpu,
        policy=args.policy,
        write_policy=args.write_policy,
        engine=args.engine,
        seed=args.seed,
        fail_rate=args.fail_rate,
        time_scale=args.time_scale,
        max_batched_tokens=args.max_batched_tokens,
        max_seqs=args.max_seqs,
        watermark=args.watermark,
        step_ms=args.step_ms,
        tokens_per_s=args.tokens_per_s,
        h2d_gbps=args.h2d_gbps,
        tp=args.tp,
        max_memory_bytes=int(args.max_memory_gib * 2**30),
    )


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
        config = _config(args)
        trace = args.trace if args.trace is not None else default_trace_path()
        requests = load_trace(trace, limit=args.limit)
        if args.sweep is not None:
            return _run_sweep(args, config, requests, trace, console)
        if wants_multi(args):
            return run_multi(args, config, requests, trace, console)
        return _run_single(args, config, requests, trace, console)
    except (KVMgrError, ValueError, OSError) as exc:  # bad input: one line, no traceback
        print(f"kvmgr simulate: error: {exc}", file=sys.stderr)
        return 2


def check_output_path(path: Path | None, flag: str, *, image: bool = False) -> None:
    """Check that ``path`` can be written (its folder exists and is writable; it is no folder).

    Args:
        path: the output file, or ``None`` (nothing to check).
        flag: the flag's name, for the message.
        image: also check that matplotlib can write the suffix (``.png``, ``.svg``, ...).

    Raises:
        ValueError: the path cannot be written, with the reason.
    """
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a folder, expected a file")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: folder {parent} does not exist")
    writable = os.access(path, os.W_OK) if path.exists() else os.access(parent, os.W_OK)
    if not writable:
        raise ValueError(f"{flag} {path}: not writable")
    if image:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            return  # the sweep reports the missing matplotlib itself
        formats = FigureCanvasBase.get_supported_filetypes()
        if path.suffix.lstrip(".").lower() not in formats:
            raise ValueError(
                f"{flag} {path}: expected a suffix matplotlib writes ({', '.join(sorted(formats))})"
            )


def _run_single(
    args: argparse.Namespace,
    config: SimConfig,
    requests: list[Any],
    trace: Path,
    console: Console,
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
    if report.page_mismatches:
        print(
            f"kvmgr simulate: error: {report.page_mismatches} loaded pages failed their "
            "fingerprint check",
            file=sys.stderr,
        )
        return 1
    return 0


def _run_sweep(
    args: argparse.Namespace,
    config: SimConfig,
    requests: list[Any],
    trace: Path,
    console: Console,
) -> int:
    try:  # fail before a long sweep, not after it
        import matplotlib  # noqa: F401
    except ImportError:
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
    gpu = config.gpu_tokens
    title = (
        f"{trace.name}: {len(requests):,} requests, {config.model}, block "
        f"{config.block_size}, GPU {'unbounded' if gpu is None else f'{gpu / 1e6:g}M'} "
        f"tokens, write-{config.write_policy}"
    )
    if args.json is not None:  # before the plot, so a bad --plot path loses nothing
        data = {"trace": str(trace), "runs": [r.to_dict() for r in reports]}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    path = plot_sweep(reports, args.plot or _DEFAULT_PLOT, title=title)
    console.print(f"plot: {path}")
    mismatches = sum(r.page_mismatches for r in reports)
    if mismatches:
        print(
            f"kvmgr simulate: error: {mismatches} loaded pages failed their fingerprint check",
            file=sys.stderr,
        )
        return 1
    return 0
