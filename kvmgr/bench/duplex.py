"""``kvmgr bench duplex``: D2H and H2D at once, per path pair, against two contiguous copies.

Offers:
    add_arguments, run      the CLI entry points

Per geometry: ``--blocks`` scattered blocks stored (GPU -> pinned host) and as many other blocks
loaded (host -> GPU) in one step, each direction on its own stream (H2D at high priority, as the
engines do). Variants:

- ``limit``: two contiguous copies of the same bytes in opposite directions at once (``torch``
  ``copy_`` on the two streams);
- every pair of ``dma`` / ``kernel`` / ``staged`` per direction (``<d2h>+<h2d>``) issued from
  one thread, the cheaper to issue first (kernel, then staged, then dma); ``dma+dma threads``: each direction's driver call on its own host
  thread (is the driver call what serializes?);
- ``contiguous+kernel`` / ``kernel+contiguous``: the kernel one way against an ideal contiguous
  DMA copy the other way (which direction of SM copies slows the link for the other; not checked
  for bytes: the contiguous half copies other buffers);
- ``staged`` as a third path (``kvmgr.transfer.staged.StagedCopy``, ``--staging-mib`` per
  direction): D2H gathered device to device, then one DMA descriptor per CPU run and tensor;
  H2D the mirror. It pays only where the CPU ids run: ``--host-runs R`` draws the CPU ids as
  runs of ``R`` consecutive blocks (the GPU ids stay scattered; 1: scattered, as before);
- ``gather d2h`` / ``scatter h2d``: the staged path's device-to-device part alone (one
  direction's bytes; ``Calibration.staged_gather_gbps`` is fitted from them);
- ``auto``: the paths and order ``kvmgr.transfer.duplex.duplex_choice`` picks (staged counts
  given);
- ``engine cuda`` / ``engine auto``: both plans through the engine's ``submit`` as a step submits
  them (``AutoEngine.plan_duplex`` first), timed on the host until both futures resolved (what a
  caller sees, completion threads included);
- ``<path> <direction>``: each direction alone.

Time = from an event recorded before the first issue to the later of the two streams' end events
(host issue time counts); median of ``--repeats``. ``ratio`` = limit time / variant time (goal
>= 0.8); ``overlap`` = the share of the shorter direction's device span spent while the other
one ran. Every pair's bytes are checked once before timing. ``--json`` writes every row;
``Calibration.from_json`` fits ``duplex_*`` from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

from kvmgr.bench._duplex_rig import Rig, check, device_parts, engines, overlap, through, timed
from kvmgr.bench._options import positive_int
from kvmgr.bench.common import GEOMETRIES, CasePool
from kvmgr.transfer.cost_model import Calibration
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.duplex import duplex_choice
from kvmgr.transfer.plan import Direction
from kvmgr.transfer.staged import staged_descriptors

__all__ = ["add_arguments", "run"]

_D2H, _H2D = Direction.D2H, Direction.H2D
#: variants whose bytes are not checked: one half copies other buffers than the plans name
_UNCHECKED = frozenset({"limit", "contiguous+kernel", "kernel+contiguous"})
#: issue order in mixed pairs: the cheapest host part first
_ISSUE_RANK = {"kernel": 0, "staged": 1, "dma": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvmgr bench duplex`` options."""
    parser.add_argument(
        "--geometries",
        nargs="+",
        default=["qwen", "llama"],
        choices=GEOMETRIES,
        help="KV geometries (tensors x page bytes) to measure",
    )
    parser.add_argument("--blocks", type=int, default=512, help="scattered blocks per direction")
    parser.add_argument(
        "--repeats", type=positive_int, default=5, help="timed runs per variant (median)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per variant first")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument(
        "--host-runs", type=int, default=1,
        help="CPU block ids in runs of this many consecutive blocks (1: scattered)",
    )  # fmt: skip
    parser.add_argument(
        "--staging-mib", type=int, default=64, help="staged path: staging MiB per direction"
    )


def run(args: argparse.Namespace) -> int:
    """Measure every geometry; print a table and JSON."""
    driver = CopyDriver()
    rows: list[dict[str, Any]] = []
    for key in args.geometries:
        try:
            new = _geometry(key, args, driver)
        except Exception as exc:  # one geometry failing keeps the others' rows
            new = [{"geometry": key, "variant": "error", "error": repr(exc)}]
        rows += new
        for row in new:  # as they come: a run cut short keeps what it measured
            print(json.dumps(row), flush=True)
        _write(args.json, rows)
    return 0


def _write(path: str | None, rows: list[dict[str, Any]]) -> None:
    """``{"duplex": rows, "calibration": the duplex_* fields fitted from them}`` to ``path``."""
    if not path:
        return
    result: dict[str, Any] = {"duplex": rows, "calibration": None}
    good = [r for r in rows if "gbps" in r]
    if good:
        fitted = Calibration.fit_duplex(good)
        result["calibration"] = {
            "duplex_kernel_gbps": fitted.duplex_kernel_gbps,
            "duplex_limit_gbps": fitted.duplex_limit_gbps,
        }
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)


def _geometry(key: str, args: argparse.Namespace, driver: CopyDriver) -> list[dict[str, Any]]:
    label = GEOMETRIES[key][0]
    rows: list[dict[str, Any]] = []
    with CasePool(key, 2 * args.blocks, driver) as pool:  # room for two disjoint sets
        rig = Rig(pool, args, driver)
        variants, alone = _variants(rig)
        plans = rig.plans
        counts = {d: (plans[d][0].num_descriptors, rig.num_bytes) for d in Direction}
        staged_counts = (staged_descriptors(plans[_D2H][0]), staged_descriptors(plans[_H2D][0]))
        choice = duplex_choice(counts[_D2H], counts[_H2D], staged=staged_counts)
        if rig.kernel is not None:  # the paths and order the model picks
            second = _H2D if choice.first is _D2H else _D2H
            variants["auto"] = rig.both(*((choice.path(d), d) for d in (choice.first, second)))
        built = engines(driver, args.staging_mib << 20)
        variants |= {f"engine {n}": through(e, plans, counts) for n, e in built.items()}
        limit_us = None
        for name, issue in list(variants.items()) + list(alone.items()):
            try:
                totals, hosts, overlaps = _measure(rig, name, issue, args, name in variants)
            except Exception as exc:  # one variant failing keeps the others
                rig.settle()
                rows.append({"geometry": label, "variant": name, "error": repr(exc)})
                continue
            us = statistics.median(totals)
            row = _row(rig, args, label, name, us, statistics.median(hosts), name in alone)
            if name == "limit":
                limit_us = us
            elif name in variants and limit_us is not None:
                row["ratio"] = round(limit_us / us, 3)
                if overlaps:
                    row["overlap"] = round(statistics.median(overlaps), 3)
            if name == "auto":
                paths = f"d2h={choice.path(_D2H)} h2d={choice.path(_H2D)}"
                row["choice"] = f"{paths} first={choice.first.value}"
                row["model_us"] = round(choice.us, 1)
                row["staged_descriptors"] = list(staged_counts)
            rows.append(row)
        for engine in built.values():
            engine.close()
    return rows


def _row(
    rig: Rig, args: argparse.Namespace, label: str, name: str, us: float, host_us: float,
    one_way: bool,
) -> dict[str, Any]:  # fmt: skip
    """A variant's row: its geometry, sizes, median times and rate (one direction's bytes for
    ``one_way`` variants, both directions' otherwise)."""
    moved = rig.num_bytes * (1 if one_way else 2)
    return {
        "geometry": label, "variant": name, "blocks": args.blocks, "host_runs": args.host_runs,
        "descriptors": rig.plans[_D2H][0].num_descriptors, "bytes": moved,
        "us": round(us, 1), "host_us": round(host_us, 1), "gbps": round(moved / us / 1e3, 2),
    }  # fmt: skip


def _variants(rig: Rig) -> tuple[dict[str, Callable[[], None]], dict[str, Callable[[], None]]]:
    """The pairs (limit, every path pair, dma on two threads, the kernel against contiguous
    copies) and the single directions (limit, every path, the staged path's device parts)."""
    variants: dict[str, Callable[[], None]] = {"limit": rig.contiguous(None)}
    alone = {f"limit {d.value}": rig.contiguous(d) for d in Direction}
    for name in rig.issuers:
        for d in Direction:
            alone[f"{name} {d.value}"] = rig.one(name, d)
    for d2h_name, h2d_name in [(a, b) for a in rig.issuers for b in rig.issuers]:
        order = [(d2h_name, _D2H), (h2d_name, _H2D)]
        if _ISSUE_RANK[h2d_name] < _ISSUE_RANK[d2h_name]:
            order.reverse()  # the cheaper host part first
        variants[f"{d2h_name}+{h2d_name}"] = rig.both(*order)
    variants["dma+dma threads"] = rig.threaded
    if rig.kernel is not None:  # the kernel against an ideal DMA copy the other way: which
        # direction of SM copies slows the link for the other (no host-bound DMA issue)
        contiguous_d2h, contiguous_h2d = rig.contiguous(_D2H), rig.contiguous(_H2D)
        kernel_d2h, kernel_h2d = rig.one("kernel", _D2H), rig.one("kernel", _H2D)
        variants["contiguous+kernel"] = lambda: (kernel_h2d(), contiguous_d2h())
        variants["kernel+contiguous"] = lambda: (kernel_d2h(), contiguous_h2d())
        assert rig.move is not None
        alone |= device_parts(rig.pool, rig.plans, rig.move, rig.streams, rig.keep)
    return variants, alone


def _measure(
    rig: Rig, name: str, issue: Callable[[], None], args: argparse.Namespace, is_pair: bool
) -> tuple[list[float], list[float], list[float]]:
    """Check a pair's bytes once (unless unchecked), then time ``--warmup`` + ``--repeats``
    issues: the timed runs' totals, host times and overlaps (us, us, shares)."""
    if is_pair and name not in _UNCHECKED:
        check(rig.pool, rig.plans, issue)
        rig.drain()
    totals, hosts, overlaps = [], [], []
    for i in range(args.warmup + args.repeats):
        total, host, spans = timed(rig.streams, issue, rig.marks)
        rig.drain()
        if name.startswith("engine "):  # issue() returned once both landed
            total = host
        if i >= args.warmup:
            totals.append(total)
            hosts.append(host)
            share = overlap(spans)
            if share is not None:
                overlaps.append(share)
    return totals, hosts, overlaps
