"""``kvmgr bench peer``, swap half: kvmgr's swaps against a C++ batched-copy op, one process.

Offers:
    CPP_SOURCE          the baseline op's C++ source (``_peer_swap_op``, after a published design)
    build_baseline      compile it with ``torch.utils.cpp_extension.load_inline`` (needs g++, ninja)
    add_arguments       options of the swap half
    run_peer_swap       run it; print the table; return rows (and write ``--json``)

Baseline: a C++ op after the published design of vLLM's ``swap_blocks_batch`` (not its code): it
takes int64 CPU tensors of source pointers, destination pointers and sizes, resolves
``cuMemcpyBatchAsync`` once with ``cuGetProcAddress(..., 12080)`` (the 12.8 ABI, with
``failIdx``), and issues the whole batch in one call on the given stream with one attribute entry
(source access order STREAM), falling back to one ``cuMemcpyAsync`` per copy where the entry point
is missing. The descriptors are built from block ids with numpy broadcasts, as a serving loop
would, and that time counts as part of the baseline's request.

Cases: 512 scattered blocks (never adjacent, one descriptor per page) of 48 x 4 KiB (Qwen2.5-0.5B,
100 MB) and of 64 x 32 KiB (Llama-3-8B, 1.07 GB), D2H and H2D. Columns, each the median of
``--repeats`` requests after ``--warmup``, in microseconds from the request to the bytes landed:

- ``kvmgr <engine>`` (``auto``, ``cuda``, ``kernel``): ``OffloadManager.swap_out`` (D2H) or
  ``swap_in`` (H2D) of the 512 blocks, then ``step()``, until the future resolves;
- ``engine <engine>``: the engine alone: ``build_plan`` + ``submit`` until its future resolves;
- ``baseline``: descriptors + the C++ op + an event, until the event has completed;
- ``contiguous``: one ``copy_`` of the same number of bytes between one GPU buffer and one
  pinned host buffer (the physical limit);

with ``x baseline`` = baseline us / column us and ``x limit`` = contiguous us / column us. Before
timing, the baseline's and each kvmgr engine's output bytes are compared (destinations poisoned
first); a mismatch is reported and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvmgr.bench._peer_swap_op import CPP_SOURCE, build_baseline
from kvmgr.bench.common import GEOMETRIES, CasePool, CopyCase
from kvmgr.transfer import make_engine
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.plan import Direction, build_plan

__all__ = ["CPP_SOURCE", "add_arguments", "build_baseline", "run_peer_swap"]

_ENGINES = ("auto", "cuda", "kernel")
_CASES = (("qwen", 512), ("llama", 512))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the swap half of ``kvmgr bench peer``."""
    parser.add_argument("--swap-repeats", type=int, default=10, help="timed requests (median)")
    parser.add_argument("--swap-warmup", type=int, default=2, help="untimed requests first")
    parser.add_argument(
        "--swap-engines",
        nargs="+",
        choices=_ENGINES,
        default=list(_ENGINES),
        help="kvmgr engines to compare",
    )
    parser.add_argument("--swap-seed", type=int, default=0, help="seeds the scattered block ids")
    parser.add_argument("--swap-json", metavar="PATH", default=None, help="also write JSON rows")


def run_peer_swap(args: argparse.Namespace) -> dict[str, Any]:
    """Run the swap half (module docstring) and print its table.

    Returns:
        ``{"rows": [...], "errors": [...], "ok": bool}``; ``ok`` is false when bytes differ.
    """
    result: dict[str, Any] = {"rows": [], "errors": [], "ok": True}
    if not torch.cuda.is_available():
        result["errors"].append("kvmgr bench peer (swap) needs a CUDA GPU")
        result["ok"] = False
        _print(result)
        return result
    try:
        op = build_baseline()
    except Exception as exc:  # no ninja or compiler on the machine: kvmgr's columns still run
        op = None
        result["errors"].append(f"baseline op not built: {type(exc).__name__}: {exc}")
    repeats, warmup = getattr(args, "swap_repeats", 10), getattr(args, "swap_warmup", 2)
    engines = getattr(args, "swap_engines", list(_ENGINES))
    rng = np.random.default_rng(getattr(args, "swap_seed", 0))
    driver = CopyDriver()
    for key, blocks in _CASES:
        with CasePool(key, blocks, driver) as pool:
            for direction in Direction:
                case = pool.case(direction, blocks, rng)
                row = _case_row(case, pool, op, engines, repeats, warmup, result)
                result["rows"].append(row)
    _print(result)
    path = getattr(args, "swap_json", None)
    if path:
        with open(path, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


def _case_row(
    case: CopyCase,
    pool: CasePool,
    op: Any,
    engines: list[str],
    repeats: int,
    warmup: int,
    result: dict[str, Any],
) -> dict[str, Any]:
    """One table row: every column's median request -> landed us for one case."""
    p = case.plan
    row: dict[str, Any] = {"geometry": case.geometry, "direction": case.direction.value,
                           "blocks": case.num_blocks, "descriptors": p.num_descriptors,
                           "bytes": p.num_bytes}  # fmt: skip
    row["contiguous"] = _median_us(_contiguous(case), repeats, warmup)
    reference = None
    if op is not None:
        try:
            baseline = _baseline(case, pool, op)
            reference = _output(case, baseline)
            row["baseline"] = _median_us(baseline, repeats, warmup)
        except Exception as exc:  # keep kvmgr's columns
            result["errors"].append(f"{case.geometry} {row['direction']} baseline: {exc!r}")
    for name in engines:
        try:
            engine = make_engine(name, torch.device("cuda"))
            try:
                request = _engine_request(case, pool, engine)
                if reference is not None and not _same(_output(case, request), reference):
                    result["errors"].append(f"{case.geometry} {row['direction']} engine {name}: "
                                            "bytes differ from the baseline's")  # fmt: skip
                    result["ok"] = False
                row[f"engine {name}"] = _median_us(request, repeats, warmup)
            finally:
                engine.close()
            row[f"kvmgr {name}"] = _manager_us(case, name, repeats, warmup)
        except Exception as exc:
            result["errors"].append(f"{case.geometry} {row['direction']} {name}: {exc!r}")
    return row


def _median_us(request: Callable[[], None], repeats: int, warmup: int) -> float:
    """Median microseconds of ``request()`` (which returns once the bytes have landed)."""
    times = []
    for i in range(warmup + repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        request()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _contiguous(case: CopyCase) -> Callable[[], None]:
    gpu = torch.empty(case.plan.num_bytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(case.plan.num_bytes, dtype=torch.uint8, pin_memory=True)
    src, dst = (gpu, host) if case.direction is Direction.D2H else (host, gpu)
    done = torch.cuda.Event()

    def request() -> None:
        with torch.cuda.stream(case.stream):
            dst.copy_(src, non_blocking=True)
            done.record(case.stream)
        done.synchronize()

    return request


def _baseline(case: CopyCase, pool: CasePool, op: Any) -> Callable[[], None]:
    """Descriptors from block ids (numpy broadcasts), the C++ op, an event."""
    src_name, dst_name = ("gpu", "host") if case.direction is Direction.D2H else ("host", "gpu")
    src, dst = pool.layouts[src_name], pool.layouts[dst_name]
    done = torch.cuda.Event()

    def request() -> None:
        srcs = (src.base_addrs[:, None] + src.block_strides[:, None] * case.src_ids).reshape(-1)
        dsts = (dst.base_addrs[:, None] + dst.block_strides[:, None] * case.dst_ids).reshape(-1)
        sizes = np.repeat(src.page_bytes, len(case.src_ids))
        op.swap_blocks_batch(torch.from_numpy(srcs), torch.from_numpy(dsts),
                             torch.from_numpy(sizes), case.stream.cuda_stream)  # fmt: skip
        done.record(case.stream)
        done.synchronize()

    return request


def _engine_request(case: CopyCase, pool: CasePool, engine: Any) -> Callable[[], None]:
    """``build_plan`` + ``submit`` until the engine's future resolves."""
    src_name, dst_name = ("gpu", "host") if case.direction is Direction.D2H else ("host", "gpu")
    layouts = pool.layouts[src_name], pool.layouts[dst_name]

    def request() -> None:
        plan = build_plan(case.direction, *layouts, case.src_ids, case.dst_ids)
        engine.submit(plan).future.result(timeout=60)

    return request


def _manager_us(case: CopyCase, engine: str, repeats: int, warmup: int) -> float:
    """Median us from ``swap_out`` / ``swap_in`` of the case's GPU blocks to the future."""
    return asyncio.run(_manager_case(case, engine, repeats, warmup))


async def _manager_case(case: CopyCase, engine: str, repeats: int, warmup: int) -> float:
    from kvmgr import ManagerConfig, OffloadManager

    gpu = case.src if case.direction is Direction.D2H else case.dst
    gpu_ids = [int(i) for i in (case.src_ids if case.direction is Direction.D2H else case.dst_ids)]
    n = len(gpu_ids)
    config = ManagerConfig(num_cpu_blocks=2 * n, engine=engine, manage_gpu_blocks=False)
    times = []
    async with OffloadManager(gpu, config) as mgr:
        if case.direction is Direction.H2D:  # loads need stored keys: store them once, untimed
            keys = [f"k{i}".encode() for i in range(n)]
            stored = mgr.swap_out(gpu_ids, keys=keys)
            await mgr.step()
            await stored
        for r in range(warmup + repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if case.direction is Direction.D2H:
                future = mgr.swap_out(gpu_ids, keys=[f"{r}:{i}".encode() for i in range(n)])
            else:
                future = mgr.swap_in(keys, gpu_ids)
            await mgr.step()
            await future
            if r >= warmup:
                times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _output(case: CopyCase, request: Callable[[], None]) -> list[torch.Tensor]:
    """Poison the destination pages, run one request, return copies of them."""
    index = torch.from_numpy(case.dst_ids)
    for t in case.dst:
        t[index.to(t.device)] = 0x5A
    torch.cuda.synchronize()
    request()
    torch.cuda.synchronize()
    return [t[index.to(t.device)].cpu() for t in case.dst]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _print(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=190)
    columns = ["baseline", "contiguous"] + [
        f"{kind} {e}" for e in _ENGINES for kind in ("kvmgr", "engine")
    ]
    table = Table(title="peer swap: request -> bytes landed, us (x baseline / x limit)")
    for head in ("geometry", "dir", "descs", "MB", *columns):
        table.add_column(head, justify="right")
    for r in result["rows"]:
        cells = [r["geometry"], r["direction"], str(r["descriptors"]), f"{r['bytes'] / 1e6:.0f}"]
        for c in columns:
            us = r.get(c)
            if us is None:
                cells.append("-")
                continue
            ratios = []
            if c not in ("baseline", "contiguous"):
                ratios.append(f"{r['baseline'] / us:.2f}x" if "baseline" in r else "-")
                ratios.append(f"{r['contiguous'] / us:.2f}")
            cells.append(f"{us:,.0f}" + (f" ({' / '.join(ratios)})" if ratios else ""))
        table.add_row(*cells)
    console.print(table)
    for error in result["errors"]:
        console.print(f"[red]error[/red]: {error}")


#: Geometries the cases use (for callers printing labels).
PEER_GEOMETRIES = {key: GEOMETRIES[key] for key, _ in _CASES}
