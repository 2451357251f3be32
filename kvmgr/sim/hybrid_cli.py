"""``kvmgr simulate-hybrid``: a hybrid model's cache groups against all layers as full attention.

Offers:
    add_arguments   the subcommand's flags
    run             run it; exit status (0, or 2 on bad input)

Replays a trace's prompts (default: the bundled Mooncake conversation trace) through a
``GroupedManager`` for each ``--variants`` entry and each ``--cpu-gib`` budget, and prints the
hit ratio, the bytes moved per hit and per restored token, and the bytes stored
(``kvmgr.sim.hybrid`` describes the variants).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from kvmgr.errors import KVMgrError
from kvmgr.sim.hybrid import VARIANTS, HybridSimConfig, VariantResult, simulate_hybrid
from kvmgr.sim.hybrid_presets import HYBRID_PRESETS
from kvmgr.sim.trace import default_trace_path, load_trace

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the subcommand's flags to ``parser``."""
    parser.add_argument("--preset", default="gpt-oss-120b", choices=sorted(HYBRID_PRESETS))
    parser.add_argument("--trace", type=Path, default=None, help="trace file (default: bundled)")
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    parser.add_argument("--block-size", type=int, default=512, help="tokens per block")
    parser.add_argument(
        "--cpu-gib", default="64,256", help="CPU budgets in GiB, comma-separated (one run each)"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of: " + ", ".join(VARIANTS))
    parser.add_argument("--policy", default="lru", help="every group's eviction policy")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")


def _row(r: VariantResult) -> dict[str, Any]:
    return {
        "variant": r.variant,
        "hit_ratio": round(r.hit_ratio, 4),
        "num_hits": r.num_hits,
        "mb_per_hit": round(r.bytes_per_hit / 1e6, 2),
        "kb_per_hit_token": round(r.bytes_per_hit_token / 1e3, 2),
        "gb_stored": round(r.bytes_stored / 1e9, 1),
        "orphans_dropped": r.orphans_dropped,
        "stores_rejected": r.stores_rejected,
        "cpu_blocks": list(r.cpu_blocks),
        "wall_s": round(r.wall_s, 1),
    }


def _table(title: str, rows: list[dict[str, Any]]) -> Table:
    """One CPU budget's variants, a row each."""
    table = Table(title=title)
    for col in (
        "variant",
        "hit ratio",
        "hits",
        "MB/hit",
        "KB/hit token",
        "GB stored",
        "orphans",
    ):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in rows:
        table.add_row(
            str(r["variant"]), f"{r['hit_ratio']:.4f}", str(r["num_hits"]),
            f"{r['mb_per_hit']:.1f}", f"{r['kb_per_hit_token']:.1f}",
            f"{r['gb_stored']:.1f}", str(r["orphans_dropped"]),
        )  # fmt: skip
    return table


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; returns the exit status."""
    console = Console()
    try:
        budgets = [float(x) for x in args.cpu_gib.split(",") if x.strip()]
        if not budgets or not all(math.isfinite(g) and g > 0 for g in budgets):
            raise ValueError(f"--cpu-gib: expected finite budgets > 0, got {args.cpu_gib!r}")
        if args.json is not None and not args.json.parent.is_dir():
            raise ValueError(f"--json: no directory {str(args.json.parent)!r}")
        variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
        base = HybridSimConfig(
            preset=args.preset, block_size=args.block_size, variants=variants, policy=args.policy
        )
        path = args.trace or default_trace_path()
        trace = load_trace(path, limit=args.limit)
    except (KVMgrError, ValueError) as exc:
        print(f"kvmgr simulate-hybrid: {exc}", file=sys.stderr)
        return 2
    out = []
    for gib in budgets:
        config = attrs.evolve(base, cpu_bytes=int(gib * 2**30))
        rows = [_row(r) for r in simulate_hybrid(config, trace)]
        title = f"{args.preset}, {len(trace)} requests of {path.name}, CPU {gib:g} GiB"
        console.print(_table(title, rows))
        out.append({"cpu_gib": gib, "runs": rows})
    console.print(
        "full: every layer as full attention (one key space); all / tail: cache groups, the "
        "window groups storing every block / only the request's last window or state."
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"preset": args.preset, "trace": str(path), "budgets": out}, indent=1)
        )
    return 0
