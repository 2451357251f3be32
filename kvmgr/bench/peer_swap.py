"""``kvmgr bench peer``, swap half: kvmgr's swaps against a C++ batched-copy op, one process.

Offers:
    CPP_SOURCE          the baseline op's C++ source (written here after a published design)
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

from kvmgr.bench.common import GEOMETRIES, CasePool, CopyCase
from kvmgr.transfer import make_engine
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.plan import Direction, build_plan

__all__ = ["CPP_SOURCE", "add_arguments", "build_baseline", "run_peer_swap"]

_ENGINES = ("auto", "cuda", "kernel")
_CASES = (("qwen", 512), ("llama", 512))

#: The baseline op. Minimal driver types are declared here, so it compiles against torch's
#: headers alone; the driver is reached through ``dlopen("libcuda.so.1")`` at the first call.
CPP_SOURCE = r"""
#include <torch/extension.h>
#include <dlfcn.h>
#include <cstdint>

namespace {

using CUresult = int;
using CUstream = void*;
struct MemLocation { int type; int id; };                     // CUmemLocation_v1
struct MemcpyAttributes {                                      // CUmemcpyAttributes_v1
  int src_access_order;
  MemLocation src_hint;
  MemLocation dst_hint;
  unsigned int flags;
};
static_assert(sizeof(MemcpyAttributes) == 24, "CUmemcpyAttributes_v1 has 24 bytes");

// PFN_cuMemcpyBatchAsync_v12080: dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs,
// failIdx, stream.
using BatchFn = CUresult (*)(void**, void**, size_t*, size_t, MemcpyAttributes*, size_t*,
                             size_t, size_t*, CUstream);
using CopyFn = CUresult (*)(uint64_t, uint64_t, size_t, CUstream);  // cuMemcpyAsync_v4000
using GetProcFn = CUresult (*)(const char*, void**, int, uint64_t, int*);  // _v2

constexpr int kOrderStream = 1;       // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
constexpr size_t kNoIndex = SIZE_MAX;

struct Driver {
  BatchFn batch = nullptr;
  CopyFn copy = nullptr;
};

void* lookup(GetProcFn get, const char* symbol, int version) {
  void* fn = nullptr;
  int status = -1;
  if (get(symbol, &fn, version, 0, &status) != 0 || status != 0) return nullptr;
  return fn;
}

Driver resolve() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(lib != nullptr, "peer swap op: cannot open libcuda.so.1");
  auto get = reinterpret_cast<GetProcFn>(dlsym(lib, "cuGetProcAddress_v2"));
  TORCH_CHECK(get != nullptr, "peer swap op: no cuGetProcAddress_v2 in the driver");
  Driver driver;
  driver.batch = reinterpret_cast<BatchFn>(lookup(get, "cuMemcpyBatchAsync", 12080));
  driver.copy = reinterpret_cast<CopyFn>(lookup(get, "cuMemcpyAsync", 4000));
  TORCH_CHECK(driver.batch != nullptr || driver.copy != nullptr,
              "peer swap op: neither cuMemcpyBatchAsync nor cuMemcpyAsync resolved");
  return driver;
}

const Driver& driver() {
  static const Driver resolved = resolve();  // once per process, thread-safe
  return resolved;
}

void check_table(const torch::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kInt64 && t.is_contiguous() &&
              t.dim() == 1 && t.numel() == n, name, ": expected a contiguous int64 CPU tensor of ",
              n, " entries");
}

}  // namespace

// Copy sizes[i] bytes from src_ptrs[i] to dst_ptrs[i] for every i, on `stream` (a CUstream
// handle), in one batched driver call. Returns whether the batched entry point was used.
bool swap_blocks_batch(const torch::Tensor& src_ptrs, const torch::Tensor& dst_ptrs,
                       const torch::Tensor& sizes, int64_t stream) {
  const int64_t n = sizes.numel();
  check_table(src_ptrs, "src_ptrs", n);
  check_table(dst_ptrs, "dst_ptrs", n);
  check_table(sizes, "sizes", n);
  if (n == 0) return true;
  const Driver& d = driver();
  auto handle = reinterpret_cast<CUstream>(stream);
  auto* dst = reinterpret_cast<void**>(dst_ptrs.data_ptr<int64_t>());
  auto* src = reinterpret_cast<void**>(src_ptrs.data_ptr<int64_t>());
  auto* len = reinterpret_cast<size_t*>(sizes.data_ptr<int64_t>());
  if (d.batch != nullptr) {
    MemcpyAttributes attrs{};
    attrs.src_access_order = kOrderStream;
    size_t attrs_index = 0;
    size_t fail_index = kNoIndex;
    CUresult r = d.batch(dst, src, len, static_cast<size_t>(n), &attrs, &attrs_index, 1,
                         &fail_index, handle);
    TORCH_CHECK(r == 0, "cuMemcpyBatchAsync failed with CUresult ", r, " at copy ",
                fail_index == kNoIndex ? -1 : static_cast<int64_t>(fail_index));
    return true;
  }
  for (int64_t i = 0; i < n; ++i) {
    CUresult r = d.copy(reinterpret_cast<uint64_t>(dst[i]), reinterpret_cast<uint64_t>(src[i]),
                        len[i], handle);
    TORCH_CHECK(r == 0, "cuMemcpyAsync failed with CUresult ", r, " at copy ", i);
  }
  return false;
}
"""


def build_baseline(verbose: bool = False) -> Any:
    """Compile and load the baseline op (cached by torch across runs).

    Returns:
        The extension module; its ``swap_blocks_batch(src_ptrs, dst_ptrs, sizes, stream)`` takes
        int64 CPU tensors ``[n]`` and a ``CUstream`` handle, returns whether it batched.

    Raises:
        RuntimeError: no compiler or ninja, or the build failed.
    """
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="kvmgr_peer_swap",
        cpp_sources=CPP_SOURCE,
        functions=["swap_blocks_batch"],
        extra_ldflags=["-ldl"],
        verbose=verbose,
    )


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
