"""``kvmgr bench pin``: where the start-up time of a pinned CPU tier goes, phase by phase.

Bytes: every variant allocates, first-touches and registers ``--gib`` GiB; figures are seconds
per GiB (``s/GiB = seconds / (bytes / 2**30)``) and the manager rows are seconds.

Variants, in one process, each on fresh memory (freed before the next):

- ``round3``: what the manager did before (``torch.empty`` + one ``cudaHostRegister`` over all
  of it, chunked at 64 GiB): the registration faults in every 4 KiB page itself.
- ``torch+touch1``: ``torch.empty``, then a first touch on ONE thread, then the registration:
  splits ``round3`` into first touch and registration of resident memory.
- ``mmap+thp``: ``mmap`` + ``MADV_HUGEPAGE``, the registration faults the (huge) pages.
- ``mmap+touchN``: ``mmap`` without the advice (4 KiB pages), first touch on ``--threads``
  threads, then the registration.
- ``mmap+thp+touchN``: huge pages and the first touch on ``--threads`` threads before.
- ``pieces``: ``PinnedRegion`` as the manager uses it (pieces of 1 GiB growing to 64 GiB, the
  first touch of piece k+1 overlapped with the registration of piece k), all before returning;
  ``pieces+thp`` the same with ``PinOptions(hugepages=True)``.
- ``manager sync`` / ``manager background``: an ``OffloadManager`` (engine ``cuda``) with a
  ``--gib`` CPU tier, ``pin_host="sync"`` / ``"background"``: seconds to construct, seconds from
  the start until a first one-block store has landed, until the tier is wholly pinned, and the
  longest event-loop stall seen while pinning went on (a 1 ms ticker; a stall of a piece's
  length would mean the registration holds the GIL).

Without a GPU only the allocation and first-touch columns are measured (registration needs the
driver). docs/guides/pinned-tier.md reads the results.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import sys
import time
from typing import Any

import torch

from kvmgr.bench._options import positive_float
from kvmgr.transfer.pinned import PinnedHostBuffer, torch_registrar
from kvmgr.transfer.pinning import PinOptions, allocate_pages, first_touch

__all__ = ["add_arguments", "run"]

GIB = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gib", type=positive_float, default=16.0, help="size of the tier, GiB")
    parser.add_argument("--threads", type=int, default=8, help="first-touch threads")
    parser.add_argument("--variants", default="all", help="comma-separated variant names, or 'all'")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _register(tensor: torch.Tensor, has_cuda: bool) -> tuple[float | None, Any]:
    """Seconds to register the tensor (in chunks of 64 GiB), and a closer."""
    if not has_cuda:
        return None, lambda: None
    registrar = torch_registrar()
    start = time.perf_counter()
    step = 64 * GIB
    done = []
    for at in range(0, tensor.numel(), step):
        registrar.register(tensor.data_ptr() + at, min(step, tensor.numel() - at))
        done.append(tensor.data_ptr() + at)
    seconds = time.perf_counter() - start

    def close() -> None:
        for address in done:
            registrar.unregister(address)

    return seconds, close


def _raw_variant(name: str, num_bytes: int, threads: int, has_cuda: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"variant": name, "alloc_s": 0.0, "touch_s": 0.0}
    if name == "round3":
        if not has_cuda:
            buffer, row["alloc_s"] = _timed(lambda: torch.empty(num_bytes, dtype=torch.uint8))
            row["register_s"] = None
        else:
            buffer, seconds = _timed(lambda: PinnedHostBuffer(num_bytes))
            row["register_s"] = buffer.register_s
            row["alloc_s"] = seconds - buffer.register_s
            buffer.close()
        del buffer
        return row
    if name.startswith("torch"):
        tensor, row["alloc_s"] = _timed(lambda: torch.empty(num_bytes, dtype=torch.uint8))
        row["hugepages"] = False
    else:
        thp = "thp" in name
        (_, tensor, advised), row["alloc_s"] = _timed(lambda: allocate_pages(num_bytes, thp))
        row["hugepages"] = advised
    touch_threads = 1 if name.endswith("touch1") else threads if "touch" in name else 0
    if touch_threads:
        start = time.perf_counter()
        first_touch(tensor, touch_threads)
        row["touch_s"] = time.perf_counter() - start
    row["register_s"], close = _register(tensor, has_cuda)
    close()
    return row  # the memory is freed with `tensor`


def _pieces_variant(name: str, num_bytes: int, threads: int, has_cuda: bool) -> dict[str, Any]:
    from kvmgr.pool.host_pool import HostRegionLayout
    from kvmgr.transfer.pinning import PinnedRegion

    row: dict[str, Any] = {"variant": name}
    if not has_cuda:
        row["register_s"] = None
        return row
    layout = HostRegionLayout((0,), (2 << 20,), num_bytes // (2 << 20), num_bytes)
    options = PinOptions(background=False, populate_threads=threads, hugepages="thp" in name)
    region, seconds = _timed(lambda: PinnedRegion(layout, torch_registrar, options))
    stats = region.statistics()
    row.update(alloc_s=stats.alloc_s, touch_s=stats.populate_wait_s, register_s=stats.register_s,
               total_s=seconds, pieces=stats.num_pieces, hugepages=stats.hugepages)  # fmt: skip
    region.close()
    del region
    return row


async def _manager_variant(mode: str, num_bytes: int) -> dict[str, Any]:
    from kvmgr import ManagerConfig, OffloadManager

    page = 1 << 20
    kv = [torch.randint(1, 255, (64, page), dtype=torch.uint8, device="cuda") for _ in range(2)]
    cfg = ManagerConfig(num_cpu_blocks=num_bytes // (2 * page), engine="cuda",
                        manage_gpu_blocks=False, pin_host=mode)  # fmt: skip
    lag = [0.0]
    start = time.perf_counter()
    mgr = OffloadManager(kv, cfg)
    constructed = time.perf_counter() - start
    async with mgr:
        ticker = asyncio.ensure_future(_ticker(lag))
        store = mgr.swap_out([0], [b"first-store-key"])
        await mgr.step()
        await store
        first_store = time.perf_counter() - start
        memory = mgr.cpu_pool.memory
        if memory is not None:
            await asyncio.to_thread(memory.wait)
        pinned = time.perf_counter() - start
        ticker.cancel()
        stats = mgr.statistics().cpu_pinning
    return {
        "variant": f"manager {mode}",
        "construct_s": constructed,
        "first_store_s": first_store,
        "all_pinned_s": pinned,
        "max_loop_stall_ms": lag[0] * 1e3,
        "pin_s": None if stats is None else stats.pin_s,
        "pieces": None if stats is None else stats.num_pieces,
    }


async def _ticker(lag: list[float]) -> None:
    while True:
        before = time.perf_counter()
        await asyncio.sleep(0.001)
        lag[0] = max(lag[0], time.perf_counter() - before - 0.001)


def _thp_settings() -> str:
    found = []
    for name in ("enabled", "defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
                found.append(f"{name} {f.read().strip()}")
        except OSError:
            found.append(f"{name} unknown")
    return ", ".join(found)


def _per_gib(value: float | None, num_bytes: int) -> str:
    return "-" if value is None else f"{value / (num_bytes / GIB):.3f}"


def _table(rows: list[dict[str, Any]], num_bytes: int) -> str:
    lines = [
        f"pinning {num_bytes / GIB:.1f} GiB; seconds per GiB (manager rows: seconds); "
        f"transparent huge pages: {_thp_settings()}",
        "",
        "| variant | alloc | first touch | register | total | huge pages |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["variant"].startswith("manager"):
            continue
        parts = [r.get("alloc_s"), r.get("touch_s"), r.get("register_s")]
        total = r.get("total_s") or (None if None in parts else sum(p for p in parts if p))
        lines.append(
            f"| {r['variant']} | {_per_gib(r.get('alloc_s'), num_bytes)} | "
            f"{_per_gib(r.get('touch_s'), num_bytes)} | {_per_gib(r.get('register_s'), num_bytes)}"
            f" | {_per_gib(total, num_bytes)} | {r.get('hugepages', '-')} |"
        )
    managers = [r for r in rows if r["variant"].startswith("manager")]
    if managers:
        lines += ["", "| manager | construct s | first store landed s | all pinned s | "
                      "max loop stall ms | pieces |", "|---|---|---|---|---|---|"]  # fmt: skip
        for r in managers:
            lines.append(
                f"| {r['variant']} | {r['construct_s']:.2f} | {r['first_store_s']:.2f} | "
                f"{r['all_pinned_s']:.2f} | {r['max_loop_stall_ms']:.1f} | {r['pieces']} |"
            )
    return "\n".join(lines)


VARIANTS = ("round3", "torch+touch1", "mmap+thp", "mmap+touchN", "mmap+thp+touchN", "pieces", "pieces+thp",
            "manager sync", "manager background")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    num_bytes = int(args.gib * GIB) // (4 << 20) * (4 << 20)
    chosen = VARIANTS if args.variants == "all" else tuple(args.variants.split(","))
    unknown = set(chosen) - set(VARIANTS)
    if num_bytes < (4 << 20) or args.threads < 1 or unknown:
        print(f"kvmgr bench pin: error: need --gib >= 0.004, --threads >= 1 and variants from "
              f"{', '.join(VARIANTS)} (got {sorted(unknown)})", file=sys.stderr)  # fmt: skip
        return 2
    if _available_bytes() < num_bytes * 1.2:
        print(f"kvmgr bench pin: error: {args.gib} GiB wanted, "
              f"{_available_bytes() / GIB:.1f} GiB available", file=sys.stderr)  # fmt: skip
        return 2
    has_cuda = torch.cuda.is_available()
    rows: list[dict[str, Any]] = []
    for name in chosen:
        gc.collect()
        if name.startswith("pieces"):
            rows.append(_pieces_variant(name, num_bytes, args.threads, has_cuda))
        elif name.startswith("manager"):
            if has_cuda:
                rows.append(asyncio.run(_manager_variant(name.split()[1], num_bytes)))
        else:
            rows.append(_raw_variant(name, num_bytes, args.threads, has_cuda))
        gc.collect()
    if not has_cuda:
        print("(no GPU: registration not measured; allocation and first touch only)")
    print(_table(rows, num_bytes))
    if args.json:
        doc = {"gib": num_bytes / GIB, "threads": args.threads, "cpus": os.cpu_count(),
               "thp": _thp_settings(),
               "machine": platform.machine(), "torch": torch.__version__, "rows": rows,
               "gpu": torch.cuda.get_device_name() if has_cuda else None}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0
