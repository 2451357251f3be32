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
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvmgr.sim.loop import SimConfig
from kvmgr.sim.multi import ROUTES, MultiReport, run_instances

__all__ = ["add_multi_arguments", "run_multi", "wants_multi"]


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
        "--disk-tokens", type=int, default=50_000_000, help="disk tier capacity per instance"
    )


def wants_multi(args: argparse.Namespace) -> bool:
    return args.instances > 1 or args.shared is not None or args.disk is not None


def _run(
    config: SimConfig, requests: list[Any], args: argparse.Namespace, tiers: bool
) -> MultiReport:
    return asyncio.run(
        run_instances(
            config,
            requests,
            num_instances=args.instances,
            route=args.route,
            shared_url=args.shared if tiers else None,
            disk_path=args.disk if tiers else None,
            disk_tokens=args.disk_tokens,
        )
    )


def _table(reports: list[tuple[str, MultiReport]], title: str) -> Table:
    table = Table(title=title)
    for column in ("run", "hit", "GPU", "CPU", "lower", "fetched", "MiB out", "MiB in", "bad"):
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
    table.add_column("instance", justify="right")
    for name, _ in reports:
        table.add_column(name, justify="right")
    for i in range(len(reports[0][1].instances)):
        table.add_row(str(i), *(f"{r.instances[i].hit_ratio:.2%}" for _, r in reports))
    return table


def run_multi(
    args: argparse.Namespace, config: SimConfig, requests: list[Any], trace: Path, console: Console
) -> int:
    if args.instances < 1:
        raise ValueError(f"--instances: expected >= 1, got {args.instances}")
    runs = [("instance-local", _run(config, requests, args, tiers=False))]
    if args.shared is not None or args.disk is not None:
        label = "+".join(x for x, on in (("disk", args.disk), ("shared", args.shared)) if on)
        runs.append((label, _run(config, requests, args, tiers=True)))
    title = f"kvmgr simulate: {trace.name}, {args.instances} instances, route {args.route}"
    console.print(_table(runs, title))
    console.print(_per_instance(runs))
    console.print(
        "hit = GPU + CPU + lower: prompt tokens served from the GPU prefix cache, the "
        "instance's CPU tier, and blocks fetched from the lower tiers; MiB out/in: bytes "
        "written to / read from the lower tiers; bad: pages that failed their fingerprint."
    )
    if args.json is not None:
        data = {
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
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    if any(r.page_mismatches for _, r in runs):
        print("kvmgr simulate: error: loaded pages failed their fingerprint check", file=sys.stderr)
        return 1
    return 0
