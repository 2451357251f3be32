"""``kvmgr simulate --instances N [--shared URL] [--disk PATH]``: the multi-instance replay.

Runs the trace through N instances twice, side by side: with the lower tiers asked for, and
without them (instance-local CPU tiers only), and prints the hit ratio per tier and per
instance, and the bytes moved to and from the lower tiers. The URL is never printed (it may
carry a password); use ``KVMGR_TIER_PASSWORD`` or a password file rather than the URL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvmgr.sim._counts import finite_count
from kvmgr.sim._progress import progress_display
from kvmgr.sim.config import SimConfig
from kvmgr.sim.multi import ROUTES, MultiReport, disk_file, run_instances

__all__ = ["add_multi_arguments", "check_multi_arguments", "run_multi", "wants_multi"]


def add_multi_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("several instances and lower tiers (docs/tiers.md)")
    g.add_argument("--instances", type=int, default=1, help="serving instances behind a router")
    g.add_argument(
        "--route", choices=ROUTES, default="session", help="how requests reach an instance"
    )
    g.add_argument(
        "--shared",
        default=None,
        metavar="URL",
        help="a Valkey/Redis server or cluster the instances share (redis://, rediss://, "
        "valkey://, redis+cluster://HOST:PORT[,HOST:PORT])",
    )
    g.add_argument("--disk", default=None, metavar="DIR", help="a local disk tier per instance")
    g.add_argument(
        "--disk-tokens",
        type=finite_count,
        default=None,
        help="disk tier capacity per instance, in tokens (K/M/G suffixes; default 50M; needs "
        "--disk); the tier's files are scratch: created fresh in DIR and deleted after the run",
    )


def wants_multi(args: argparse.Namespace) -> bool:
    """Whether the flags ask for the multi-instance replay."""
    return args.instances > 1 or args.shared is not None or args.disk is not None


def check_multi_arguments(args: argparse.Namespace) -> None:
    """Refuse, before any run, what the multi-instance replay cannot do.

    Raises:
        ValueError: ``--instances`` < 1; ``--disk-tokens`` without ``--disk``; ``--sweep`` or ``--policy opt`` with several instances
            or lower tiers; a ``--disk`` folder that does not exist or is not writable; a
            ``--shared`` server that cannot be reached or refuses the password.
    """
    if args.instances < 1:
        raise ValueError(f"--instances: expected >= 1, got {args.instances}")
    if getattr(args, "disk_tokens", None) is not None and args.disk is None:
        raise ValueError("--disk-tokens sizes the disk tier: give --disk DIR too")
    if not wants_multi(args):
        return
    flags = ", ".join(
        flag
        for flag, on in (
            (f"--instances {args.instances}", args.instances > 1),
            ("--shared", args.shared is not None),
            ("--disk", args.disk is not None),
        )
        if on
    )
    if getattr(args, "sweep", None) is not None:
        raise ValueError(f"--sweep runs one instance without lower tiers; drop {flags}")
    if args.policy == "opt":
        raise ValueError(
            "--policy opt (the offline optimum) needs the whole trace's future of one CPU tier; "
            f"it runs only in a single-instance replay: drop {flags} or pick another policy"
        )
    if args.disk is not None:
        folder = Path(args.disk)
        if not folder.is_dir():
            raise ValueError(f"--disk {folder}: no such folder")
        if not os.access(folder, os.W_OK):
            raise ValueError(f"--disk {folder}: not writable")
    if args.shared is not None:
        asyncio.run(_probe_shared(args.shared))


async def _probe_shared(url: str) -> None:
    """One lookup on the server; raises ValueError (no URL in it) when the call failed."""
    from kvmgr.errors import KVMgrError
    from kvmgr.tiers import SharedTier

    tier = SharedTier(url, single_tenant=True)
    try:
        await tier.contains_many([b"kvmgr-simulate-probe"])
        stats = tier.statistics()
    except KVMgrError as exc:  # messages name servers, never credentials
        raise ValueError(f"--shared: the server cannot be used: {exc}") from None
    finally:
        await tier.aclose()
    if stats.num_errors or stats.num_timeouts:
        raise ValueError(f"--shared: the server cannot be used: {stats.last_error}")


def _run(
    config: SimConfig,
    requests: list[Any],
    args: argparse.Namespace,
    tiers: bool,
    console: Console,
    label: str,
) -> MultiReport:
    with progress_display(console, args.quiet) as progress:
        task = progress.add_task(f"requests ({label})", total=len(requests))
        return asyncio.run(
            run_instances(
                config,
                requests,
                num_instances=args.instances,
                route=args.route,
                shared_url=args.shared if tiers else None,
                disk_path=args.disk if tiers else None,
                disk_tokens=args.disk_tokens,
                progress=lambda done, _total: progress.update(task, completed=done),
            )
        )


def _table(reports: list[tuple[str, MultiReport]], title: str) -> Table:
    table = Table(title=title)
    width = max(len(name) for name, _ in reports)
    table.add_column("run", no_wrap=True, min_width=width)  # never "instanc…"
    for column in ("hit", "GPU", "CPU", "lower", "fetched", "MiB out", "MiB in", "bad"):
        table.add_column(column, justify="right")
    for name, r in reports:
        table.add_row(
            name,
            f"{r.hit_ratio:.2%}",
            f"{r.gpu_hit_ratio:.2%}",
            f"{r.cpu_hit_ratio:.2%}",
            f"{r.lower_hit_ratio:.2%}",
            f"{r.fetched_blocks:,}",
            f"{r.tier_bytes_written / 2**20:,.1f}",
            f"{r.tier_bytes_read / 2**20:,.1f}",
            f"{r.page_mismatches}",
        )
    return table


def _per_instance(reports: list[tuple[str, MultiReport]]) -> Table:
    table = Table(title="hit ratio per instance")
    table.add_column("instance", justify="right", no_wrap=True)
    for name, _ in reports:
        table.add_column(name, justify="right", no_wrap=True, min_width=len(name))
    for i in range(len(reports[0][1].instances)):
        table.add_row(str(i), *(f"{r.instances[i].hit_ratio:.2%}" for _, r in reports))
    return table


def _json(
    runs: list[tuple[str, MultiReport]], args: argparse.Namespace, trace: Path
) -> dict[str, Any]:
    """The ``--json`` document of a multi-instance replay: each run's figures by name."""
    return {
        "trace": str(trace),
        "instances": args.instances,
        "route": args.route,
        "runs": {
            name: {
                k: v
                for k, v in (
                    ("hit_ratio", r.hit_ratio),
                    ("gpu_hit_ratio", r.gpu_hit_ratio),
                    ("cpu_hit_ratio", r.cpu_hit_ratio),
                    ("lower_hit_ratio", r.lower_hit_ratio),
                    ("fetched_blocks", r.fetched_blocks),
                    ("tier_bytes_written", r.tier_bytes_written),
                    ("tier_bytes_read", r.tier_bytes_read),
                    ("per_instance_hit_ratio", [i.hit_ratio for i in r.instances]),
                    ("page_mismatches", r.page_mismatches),
                    ("wall_s", r.wall_s),
                )
            }
            for name, r in runs
        },
    }


def run_multi(
    args: argparse.Namespace, config: SimConfig, requests: list[Any], trace: Path, console: Console
) -> int:
    """Replay without and with the lower tiers, print the split, write ``--json``; the exit
    status (1 when loaded pages failed their fingerprint check)."""
    if args.disk is not None:  # (the flags were checked by check_multi_arguments)
        stale = [disk_file(args.disk, i) for i in range(args.instances)]
        stale = [p for p in stale if p.exists()]
        if stale:
            console.print(
                f"--disk: {len(stale)} disk tier file(s) of an earlier run found in {args.disk}: "
                "deleted; this run starts cold"
            )
    runs = [("instance-local", _run(config, requests, args, False, console, "instance-local"))]
    if args.shared is not None or args.disk is not None:
        label = "+".join(x for x, on in (("disk", args.disk), ("shared", args.shared)) if on)
        runs.append((label, _run(config, requests, args, True, console, label)))
    title = f"kvmgr simulate: {trace.name}, {args.instances} instances, route {args.route}"
    console.print(_table(runs, title))
    console.print(_per_instance(runs))
    console.print(
        "hit = GPU + CPU + lower: prompt tokens served from the GPU prefix cache, the "
        "instance's CPU tier, and blocks fetched from the lower tiers; MiB out/in: bytes "
        "written to / read from the lower tiers; bad: pages that failed their fingerprint."
    )
    if args.json is not None:
        args.json.write_text(json.dumps(_json(runs, args, trace), indent=2) + "\n")
    if any(r.page_mismatches for _, r in runs):
        print("kvmgr simulate: error: loaded pages failed their fingerprint check", file=sys.stderr)
        return 1
    return 0
