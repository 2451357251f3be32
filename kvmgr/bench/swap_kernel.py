"""``kvmgr bench swap-kernel``: the copy kernel and ``auto`` against the batched DMA, one process.

Offers:
    add_arguments, run  the benchmark: copy table, program-cap sweep, interference

Copies: the ``kvmgr bench swap`` geometries (48 x 4 KiB, 64 x 32 KiB, 61 x 41,984 B pages) at 64 and
512 scattered blocks (one descriptor per page), both directions, between GPU tensors and one
registered host region. Bytes = blocks x tensors x page bytes; GB/s = bytes / device s / 1e9 with
device seconds from CUDA events around the issue on the copy stream, so host work inside the issue
(the driver's per-descriptor cost; the kernel's table staging) counts. Median of ``--repeats``.
Every column is verified against the source (destination poisoned) before it is timed.

Interference: one engine copies the Qwen geometry (512 blocks) on a copy stream while a loop of
``--matmuls`` bf16 ``N x N`` matmuls runs on a compute stream. Each repeat runs three *windows*
in turn, each opened by the same gate (a sleep kernel long enough for the host to enqueue the
whole window, so host issue time never paces the device): copies alone, matmuls alone, both. The
copies are enqueued back to back, enough of them (from a gated probe of one copy's device time)
to cover twice the matmul loop, so the matmul runs under copy traffic from its first to its last
kernel (``covered %`` checks it). Per repeat: matmul slowdown = during / alone - 1 (a pair run
back to back, so clock and thermal drift cancel); copy GB/s alone over all its copies, and during
over the copies that ended inside the matmul window; ``loop+offload ms``: the matmul loop's time
with the copies running (what a serving step that overlaps its offload takes). Reported: medians over
``--interference-repeats`` (and the slowdown's range); ``gate ok`` says every enqueue finished
before its gate opened.

``--json`` writes the rows plus ``"calibration"``: the cost model fitted to this run's batch and
kernel rows and its interference slowdowns (``Calibration.fit``; DMA bandwidth stays at the defaults' 1 GiB peak, which
``kvmgr bench swap`` measures), which ``Calibration.from_json`` reads back.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import attrs
import numpy as np
import torch

from kvmgr.bench._interference import interference_rows
from kvmgr.bench._options import add_cases, add_output, positive_int
from kvmgr.bench._swap_print import print_swap_kernel
from kvmgr.bench.common import (
    GEOMETRIES,
    CasePool,
    CopyCase,
    Variant,
    auto_variant,
    default_variants,
    kernel_variant,
    time_issue,
    verify,
)
from kvmgr.errors import ConfigError
from kvmgr.transfer.cost_model import Calibration, kernel_or_batch
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.plan import Direction

__all__ = ["add_arguments", "run"]

_TARGET_GBPS, _TARGET_X_BATCH, _AUTO_SLACK = 40.0, 8.0, 1.05  # auto may be 5% slower (noise)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvmgr bench swap-kernel``."""
    add_cases(parser, GEOMETRIES)
    parser.add_argument(
        "--programs",
        nargs="*",
        type=int,
        default=[8, 16, 32],
        help="program caps to sweep as kernel@N columns (the kernel column: D2H 8, H2D 32)",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=10, help="timed runs per column (median)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--matmul", type=int, default=8192, help="N of the bf16 N x N matmul; 0 skips"
    )
    parser.add_argument("--matmuls", type=int, default=20, help="matmuls per interference window")
    parser.add_argument(
        "--interference-repeats", type=int, default=5, help="window triples per column (median)"
    )
    parser.add_argument("--calibration", default=None, help="JSON for auto's cost model")
    add_output(parser)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print tables; write ``--json``. Returns the exit status."""
    if not torch.cuda.is_available():
        print("kvmgr bench swap-kernel needs a CUDA GPU")
        return 2
    calib = Calibration.from_json(args.calibration) if args.calibration else None
    columns = {
        "batch": default_variants()["batch_c"],
        "kernel": kernel_variant(),
        "auto": auto_variant(calib),
    }
    columns |= {f"kernel@{n}": kernel_variant(n) for n in args.programs}
    result = _measure(args, columns, calib)
    result["targets"] = _targets(result["copies"])
    try:
        fitted = Calibration.fit(result["copies"], calib, interference_rows=result["interference"])
        result["calibration"] = attrs.asdict(fitted)
    except ConfigError as exc:
        result["errors"].append(f"calibration fit: {exc}")
    print_swap_kernel(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    ok = all(r["ok"] for r in result["copies"]) and all(t["ok"] for t in result["targets"])
    return 0 if ok else 1


def _measure(
    args: argparse.Namespace, columns: dict[str, Variant], calib: Calibration | None
) -> dict[str, Any]:
    """Every column over every geometry, block count and direction; on ``qwen``, the matmul
    interference of each column but ``auto``."""
    rng = np.random.default_rng(args.seed)
    result: dict[str, Any] = {"copies": [], "interference": [], "errors": []}
    driver = CopyDriver()
    for key in args.geometries:
        with CasePool(key, max(args.blocks), driver) as pool:
            for blocks in args.blocks:
                for direction in Direction:
                    case = pool.case(direction, blocks, rng)
                    for name, variant in columns.items():
                        result["copies"].append(_row(case, name, variant, args, calib))
            if key == "qwen" and args.matmul > 0:
                busy = {k: v for k, v in columns.items() if k != "auto"}
                for direction in Direction:
                    case = pool.case(direction, max(args.blocks), rng)
                    try:  # keep the copy table if the interference run fails (e.g. out of memory)
                        result["interference"] += interference_rows(case, busy, args)
                    except Exception as exc:
                        result["errors"].append(f"interference {direction.value}: {exc!r}")
    return result


def _row(
    case: CopyCase, name: str, variant: Variant, args: argparse.Namespace, calib: Calibration | None
) -> dict[str, Any]:
    issue = variant(case)
    ok = verify(case, issue, 0x5A + len(name))
    device_us, host_us = time_issue(issue, case.stream, args)
    p = case.plan
    auto_path = kernel_or_batch(p.num_descriptors, p.num_bytes, p.direction, calib)
    path = auto_path if name == "auto" else name.split("@")[0]
    return {
        "geometry": case.geometry,
        "direction": case.direction.value,
        "blocks": case.num_blocks,
        "descriptors": p.num_descriptors,
        "bytes": p.num_bytes,
        "variant": name,
        "path": path,
        "us": device_us,
        "host_us": host_us,
        "gbps": p.num_bytes / device_us / 1e3,
        "ok": ok,
    }


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, one row per check: ``value`` against ``goal``."""
    by = {(r["geometry"], r["direction"], r["blocks"], r["variant"]): r for r in rows}
    out = []
    for (geometry, direction, blocks, variant), r in by.items():
        batch_us = by[(geometry, direction, blocks, "batch")]["us"]
        case = f"{geometry} {direction} {blocks}"
        if variant == "auto":
            out.append(
                _check(f"auto us / batch us: {case}", r["us"] / batch_us, _AUTO_SLACK, False)
            )
        if variant == "kernel" and geometry == GEOMETRIES["qwen"][0] and blocks == 512:
            out.append(_check(f"kernel GB/s: {case}", r["gbps"], _TARGET_GBPS, True))
            out.append(_check(f"kernel x batch: {case}", batch_us / r["us"], _TARGET_X_BATCH, True))
    return out


def _check(check: str, value: float, goal: float, at_least: bool) -> dict[str, Any]:
    ok = value >= goal if at_least else value <= goal
    return {"check": check, "value": value, "goal": goal, "ok": ok}
