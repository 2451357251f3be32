"""``kvmgr bench swap``: batched driver copy vs a per-page loop vs the pinned peak, one process.

Offers:
    add_arguments, run      the CLI entry points

Bytes per case: ``num_blocks x num_tensors x page_bytes``; GB/s = bytes / device seconds / 1e9,
device seconds from CUDA events around the issue (so host issue time counts when it dominates),
median of ``--repeats`` after ``--warmup`` runs. Block ids are random and never adjacent, so each
page is one descriptor and merging cannot hide the per-descriptor cost. Every variant's result is
checked against the source before timing (destination pages poisoned first). Columns:
``kvmgr.bench.common.all_variants``: the driver's call paths, the engines' kernel issue (``kernel``:
the paged kernel on the plan's runs; ``kernel_desc``: the same issuer from the plan's descriptor
table, the path before the paged kernel) and ``auto``.

``step()`` host time: ``--step-swaps`` one-block stores of the Qwen geometry (48 x 4 KiB) queued,
then one ``OffloadManager.step()`` timed, per engine (``--step-engines``) and for consecutive GPU
ids (merged into 48 descriptors) and scattered ones (one descriptor per page). Medians of
``--repeats`` steps, each column on its own: ``host`` = ``StepReport.host_s``; ``engine`` = the
engine's ``submit`` (``statistics().submit_s``), of which ``issue`` = the driver calls or the
kernel's table staging and launch (``issue_s``); ``manager`` = host - engine (hooks, queue,
planning, reports); ``plan`` = ``build_plan`` alone on the step's ids, timed apart (it builds no
descriptors: the DMA issuer builds them inside ``issue``, the paged kernel never); ``wall`` =
``step()`` as the caller sees it; ``landed`` = from the first ``swap_out`` call to the last
future resolved (bytes on the host). Targets (issue 12): 150 us consecutive, 300 us scattered.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvmgr.bench._options import add_cases, add_output, positive_int
from kvmgr.bench._swap_print import print_swap
from kvmgr.bench.common import (
    GEOMETRIES,
    CasePool,
    CopyCase,
    Variant,
    all_variants,
    select_variants,
    time_issue,
    verify,
)
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.pinned import PinnedHostBuffer
from kvmgr.transfer.plan import Direction, build_plan

__all__ = ["add_arguments", "run"]

_PEAK_BYTES = 1 << 30
_STEP_ENGINES = ("cuda", "kernel", "auto")
_STEP_TARGET_US = {"consecutive": 150.0, "scattered": 300.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvmgr bench swap``."""
    add_cases(parser, GEOMETRIES)
    parser.add_argument(
        "--repeats", type=positive_int, default=10, help="timed runs per variant (median)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="subset of columns (batch_ctypes: old name of batch_c)",
    )
    parser.add_argument("--step-swaps", type=int, default=512, help="0 skips the step() timing")
    parser.add_argument(
        "--step-engines", nargs="+", choices=_STEP_ENGINES, default=list(_STEP_ENGINES)
    )
    add_output(parser)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print tables; write ``--json``. Returns the exit status."""
    if not torch.cuda.is_available():
        print("kvmgr bench swap needs a CUDA GPU")
        return 2
    from kvmgr.transfer.info import collect_info

    rng = np.random.default_rng(args.seed)
    driver = CopyDriver()
    stream = torch.cuda.Stream()
    variants = select_variants(all_variants(), args.variants)
    result: dict[str, Any] = {"info": collect_info(probe_pinned=False)}
    result["peak"] = _peaks(driver, stream, args)
    peak_gbps = {r["direction"]: r["gbps"] for r in result["peak"] if r["memory"] == "registered"}
    result["copies"] = []
    for key in args.geometries:
        with CasePool(key, max(args.blocks), driver) as pool:
            for blocks in args.blocks:
                for direction in Direction:
                    case = pool.case(direction, blocks, rng)
                    peak = peak_gbps.get(direction.value)
                    result["copies"] += _case_rows(case, variants, peak, args)
    result["step"] = _step_rows(args) if args.step_swaps > 0 else []
    print_swap(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
    return 0 if all(r["ok"] for r in result["copies"]) else 1


def _peaks(
    driver: CopyDriver, stream: torch.cuda.Stream, args: argparse.Namespace
) -> list[dict[str, Any]]:
    gpu = torch.empty(_PEAK_BYTES, dtype=torch.uint8, device="cuda")
    registered = PinnedHostBuffer(_PEAK_BYTES)
    hostalloc = torch.empty(_PEAK_BYTES, dtype=torch.uint8, pin_memory=True)
    rows = []
    try:
        for memory, host in (("registered", registered.tensor), ("cudaHostAlloc", hostalloc)):
            for direction in Direction:
                src, dst = (gpu, host) if direction is Direction.D2H else (host, gpu)
                dsts, srcs, sizes = (
                    np.array([p], dtype=np.int64)
                    for p in (dst.data_ptr(), src.data_ptr(), _PEAK_BYTES)
                )
                issue = functools.partial(driver.loop, dsts, srcs, sizes, stream.cuda_stream)
                device_us, _ = time_issue(issue, stream, args)
                rows.append(
                    {
                        "memory": memory,
                        "direction": direction.value,
                        "bytes": _PEAK_BYTES,
                        "us": device_us,
                        "gbps": _PEAK_BYTES / device_us / 1e3,
                    }
                )
    finally:
        registered.close()
    return rows


def _case_rows(
    case: CopyCase, variants: dict[str, Variant], peak_gbps: float | None, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows, loop_us = [], None
    num_bytes = case.plan.num_bytes
    for poison, (name, variant) in enumerate(variants.items()):
        issue = variant(case)
        ok = verify(case, issue, 0x5A + poison)
        device_us, host_us = time_issue(issue, case.stream, args)
        loop_us = device_us if name == "loop" else loop_us
        gbps = num_bytes / device_us / 1e3
        rows.append(
            {
                "geometry": case.geometry,
                "direction": case.direction.value,
                "blocks": case.num_blocks,
                "pages": case.plan.num_pages,
                "descriptors": case.plan.num_descriptors,
                "bytes": num_bytes,
                "variant": name,
                "us": device_us,
                "host_us": host_us,
                "gbps": gbps,
                "x_loop": None if loop_us is None else loop_us / device_us,
                "pct_peak": None if not peak_gbps else 100 * gbps / peak_gbps,
                "ok": ok,
            }
        )
    return rows


def _step_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``step()`` host time per engine and id pattern (module docstring); a failing engine
    (no Triton, say) becomes a row with its error, the others still run."""
    rows = []
    for engine in args.step_engines:
        for scattered in (False, True):
            ids = "scattered" if scattered else "consecutive"
            try:
                rows.append(asyncio.run(_step_case(args, engine, scattered)))
            except Exception as exc:
                rows.append({"engine": engine, "ids": ids, "error": f"{type(exc).__name__}: {exc}"})
    return rows


async def _step_case(args: argparse.Namespace, engine: str, scattered: bool) -> dict[str, Any]:
    from kvmgr import ManagerConfig, OffloadManager

    _, num_tensors, page_bytes = GEOMETRIES["qwen"]
    swaps = args.step_swaps
    gpu_kv = [
        torch.randint(0, 256, (2 * swaps + 1, page_bytes), dtype=torch.uint8, device="cuda")
        for _ in range(num_tensors)
    ]
    config = ManagerConfig(num_cpu_blocks=8 * swaps, engine=engine, manage_gpu_blocks=False)
    rng = np.random.default_rng(args.seed)
    gpu_ids = 2 * rng.permutation(swaps) if scattered else np.arange(swaps)
    samples: dict[str, list[float]] = {}
    async with OffloadManager(gpu_kv, config) as mgr:
        for r in range(args.warmup + args.repeats):
            step, report, before, after = await _step_round(mgr, r, gpu_ids, r >= args.warmup)
            for key, seconds in step.items():
                samples.setdefault(key, []).append(seconds * 1e6)
    return {
        "engine": engine,
        "ids": "scattered" if scattered else "consecutive",
        "swaps": swaps,
        "tensors": num_tensors,
        "pages": swaps * num_tensors,
        "descriptors": report.d2h.descriptors,
        "path": _step_path(before, after),
        **{key: statistics.median(values) for key, values in samples.items()},
        "target_us": _STEP_TARGET_US["scattered" if scattered else "consecutive"],
    }


async def _step_round(
    mgr: Any, r: int, gpu_ids: np.ndarray, measured: bool
) -> tuple[dict[str, float], Any, Any, Any]:
    """Round ``r``: one one-block store per GPU id, ``step()``, await them all. Returns the
    seconds by part (empty when not ``measured``), the step's report, and the engine's
    statistics before and after the step."""
    asked = time.perf_counter()
    futures = [mgr.swap_out([int(g)], keys=[f"{r}:{i}".encode()]) for i, g in enumerate(gpu_ids)]
    before = mgr.engine.statistics()
    t0 = time.perf_counter()
    report = await mgr.step()
    wall_s = time.perf_counter() - t0
    after = mgr.engine.statistics()
    results = await asyncio.gather(*futures)
    landed_s = time.perf_counter() - asked
    if not measured:
        return {}, report, before, after
    engine_s = _delta(before, after, "submit_s")
    cpu_ids = np.concatenate([_cpu_ids(res) for res in results])
    step = {
        "host_us": report.host_s,
        "manager_us": report.host_s - engine_s,
        "plan_us": _plan_s(mgr, gpu_ids, cpu_ids),
        "engine_us": engine_s,
        "issue_us": _delta(before, after, "issue_s"),
        "wall_us": wall_s,
        "landed_us": landed_s,
    }
    return step, report, before, after


def _cpu_ids(result: Any) -> np.ndarray:
    """A swap result's CPU block ids (``cpu_block_ids`` in manager v2, ``block_ids`` before)."""
    ids = getattr(result, "cpu_block_ids", None)
    return np.asarray(result.block_ids if ids is None else ids, dtype=np.int64)


def _delta(before: Any, after: Any, field: str) -> float:
    return float(getattr(after, field, 0.0) - getattr(before, field, 0.0))


def _step_path(before: Any, after: Any) -> str:
    """The path of the last step's batch, from the engine's counters."""
    if _delta(before, after, "kernel_batches") > 0:
        return "kernel"
    if _delta(before, after, "loop_fallbacks") > 0:
        return "loop"
    return "batch" if after.path in ("kernel", "auto") else str(after.path)


def _plan_s(mgr: Any, gpu_ids: np.ndarray, cpu_ids: np.ndarray) -> float:
    """Median seconds of ``build_plan`` for the step's store, timed apart from the manager."""
    layouts = (mgr.gpu_layout, mgr.cpu_pool.layout)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        build_plan(Direction.D2H, *layouts, gpu_ids, cpu_ids, merge=mgr.config.merge)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
