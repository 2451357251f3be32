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
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvmgr.bench.common import GEOMETRIES, CasePool
from kvmgr.kernels.copy.row import KERNEL_AVAILABLE
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer.cost_model import Calibration
from kvmgr.transfer.dma import DmaCopy
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.duplex import duplex_choice
from kvmgr.transfer.kernel import KernelCopy
from kvmgr.transfer.plan import Direction, build_plan
from kvmgr.transfer.staged import StagedCopy, staged_descriptors

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
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median)")
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


def _host_ids(pool: CasePool, n: int, run: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` distinct CPU ids: scattered (``run`` 1, never adjacent), else runs of ``run``
    consecutive ids at least ``run`` apart, in random order."""
    if run <= 1:
        return 2 * rng.choice(pool.size // 2, n, replace=False)
    num_runs = -(-n // run)
    slots = pool.size // (2 * run)
    if slots < num_runs:
        raise ValueError(f"--host-runs {run}: {num_runs} runs do not fit {pool.size} blocks")
    starts = 2 * run * rng.choice(slots, num_runs, replace=False)
    return (starts[:, None] + np.arange(run)[None, :]).reshape(-1)[:n]


def _plans(pool: CasePool, blocks: int, rng: np.random.Generator, run: int = 1) -> dict[Direction, Any]:  # fmt: skip
    """Disjoint scattered GPU blocks and host blocks (scattered or in runs of ``run``) for a
    store and a load."""
    gpu = 2 * rng.choice(pool.size // 2, 2 * blocks, replace=False)
    host = _host_ids(pool, 2 * blocks, run, rng)
    g, h = pool.layouts["gpu"], pool.layouts["host"]
    return {
        _D2H: (build_plan(_D2H, g, h, gpu[:blocks], host[:blocks]), gpu[:blocks], host[:blocks]),
        _H2D: (build_plan(_H2D, h, g, host[blocks:], gpu[blocks:]), host[blocks:], gpu[blocks:]),
    }


def _timed(
    streams: dict[Direction, torch.cuda.Stream],
    issue: Callable[[], None],
    marks: dict[Direction, tuple[Any, Any]],
) -> tuple[float, float, dict[Direction, tuple[float, float]]]:
    """(total us, host us, per-direction (start, end) us from the origin) of one ``issue``.

    ``marks`` is filled by the issue itself (``one()``: events recorded on a direction's stream
    right before and after its issue), so a direction issued late starts late; directions
    without marks (contiguous copies, other threads' issues) get no span."""
    origin = torch.cuda.Event(enable_timing=True)
    ends = {d: torch.cuda.Event(enable_timing=True) for d in Direction}
    marks.clear()
    torch.cuda.synchronize()
    origin.record(streams[_D2H])
    streams[_H2D].wait_event(origin)
    t0 = time.perf_counter()
    issue()
    host_us = (time.perf_counter() - t0) * 1e6
    for d in Direction:
        ends[d].record(streams[d])
    torch.cuda.synchronize()
    total = max(origin.elapsed_time(e) for e in ends.values()) * 1e3
    spans = {d: (origin.elapsed_time(a) * 1e3, origin.elapsed_time(b) * 1e3)
             for d, (a, b) in marks.items()}  # fmt: skip
    return total, host_us, spans


def _overlap(spans: dict[Direction, tuple[float, float]]) -> float | None:
    if len(spans) < 2:
        return None
    (a0, a1), (b0, b1) = spans[_D2H], spans[_H2D]
    shorter = min(a1 - a0, b1 - b0)
    return max(0.0, min(a1, b1) - max(a0, b0)) / shorter if shorter > 0 else 0.0


def _geometry(key: str, args: argparse.Namespace, driver: CopyDriver) -> list[dict[str, Any]]:
    label = GEOMETRIES[key][0]
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    with CasePool(key, 2 * args.blocks, driver) as pool:  # room for two disjoint sets
        streams = {_D2H: torch.cuda.Stream(priority=0), _H2D: torch.cuda.Stream(priority=-1)}
        plans = _plans(pool, args.blocks, rng, args.host_runs)
        num_bytes = plans[_D2H][0].num_bytes
        dma = DmaCopy(driver, "batch", 8192)
        # with its index: KernelCopy takes the paged path only for layouts on its own device
        # (a plain "cuda" device made every kernel row here use the descriptor kernel)
        cuda = torch.device("cuda", torch.cuda.current_device())
        kernel = KernelCopy(cuda, driver) if KERNEL_AVAILABLE else None
        issuers: dict[str, Any] = {"dma": dma}
        move = None
        if kernel is not None:
            move = KernelCopy(cuda, driver, d2h_programs=32, h2d_programs=32)
            staged = StagedCopy(cuda, move, dma, staging_bytes=args.staging_mib << 20)
            issuers |= {"kernel": kernel, "staged": staged}
        keep: list[Any] = []
        marks: dict[Direction, tuple[Any, Any]] = {}

        def drain() -> None:  # after a synchronize: table slots go back to their pool
            for issued in keep:
                if issued.release is not None:
                    issued.release()
            keep.clear()

        def one(name: str, direction: Direction) -> Callable[[], None]:
            def issue() -> None:
                stream = streams[direction]
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # fmt: skip
                start.record(stream)
                issued = issuers[name].issue(plans[direction][0], stream)
                end.record(stream)
                marks[direction] = (start, end)
                if issued.error is not None:
                    raise issued.error
                keep.append(issued)  # released by drain() after the streams synchronized

            return issue

        def both(first: tuple[str, Direction], second: tuple[str, Direction]) -> Callable[[], None]:
            a, b = one(*first), one(*second)
            return lambda: (a(), b())

        device = torch.cuda.current_device()

        def on_thread(issue: Callable[[], None]) -> Callable[[], None]:
            def target() -> None:
                torch.cuda.set_device(device)  # the context current on this thread too
                issue()

            return target

        def threaded() -> None:
            workers = [threading.Thread(target=on_thread(one("dma", d))) for d in Direction]
            for w in workers:
                w.start()
            for w in workers:
                w.join()

        # the limit: two contiguous copies of the same bytes, opposite directions
        gpu_src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device="cuda")
        gpu_dst = torch.empty_like(gpu_src)
        host_dst = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        host_src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8).pin_memory()

        def contiguous(direction: Direction | None) -> Callable[[], None]:
            def issue() -> None:
                if direction in (None, _D2H):
                    with torch.cuda.stream(streams[_D2H]):
                        host_dst.copy_(gpu_src, non_blocking=True)
                if direction in (None, _H2D):
                    with torch.cuda.stream(streams[_H2D]):
                        gpu_dst.copy_(host_src, non_blocking=True)

            return issue

        variants: dict[str, Callable[[], None]] = {"limit": contiguous(None)}
        alone: dict[str, Callable[[], None]] = {
            f"limit {d.value}": contiguous(d) for d in Direction
        }
        for name in issuers:
            for d in Direction:
                alone[f"{name} {d.value}"] = one(name, d)
        pairs = [(a, b) for a in issuers for b in issuers]
        for d2h_name, h2d_name in pairs:
            order = [(d2h_name, _D2H), (h2d_name, _H2D)]
            if _ISSUE_RANK[h2d_name] < _ISSUE_RANK[d2h_name]:
                order.reverse()  # the cheaper host part first
            variants[f"{d2h_name}+{h2d_name}"] = both(*order)
        variants["dma+dma threads"] = threaded
        if kernel is not None:  # the kernel against an ideal DMA copy the other way: which
            # direction of SM copies slows the link for the other (no host-bound DMA issue)
            contiguous_d2h, contiguous_h2d = contiguous(_D2H), contiguous(_H2D)
            kernel_d2h, kernel_h2d = one("kernel", _D2H), one("kernel", _H2D)
            variants["contiguous+kernel"] = lambda: (kernel_h2d(), contiguous_d2h())
            variants["kernel+contiguous"] = lambda: (kernel_d2h(), contiguous_h2d())
            assert move is not None
            alone |= _device_parts(pool, plans, move, streams, keep)
        counts = {d: (plans[d][0].num_descriptors, num_bytes) for d in Direction}
        staged_counts = (staged_descriptors(plans[_D2H][0]), staged_descriptors(plans[_H2D][0]))
        choice = duplex_choice(counts[_D2H], counts[_H2D], staged=staged_counts)
        if kernel is not None:
            names = {d: choice.path(d) for d in Direction}
            second = _H2D if choice.first is _D2H else _D2H
            variants["auto"] = both((names[choice.first], choice.first), (names[second], second))
        engines = _engines(driver, args.staging_mib << 20)
        for engine_name, engine in engines.items():
            variants[f"engine {engine_name}"] = _through(engine, plans, counts)
        limit_us = None
        for name, issue in list(variants.items()) + list(alone.items()):
            totals, hosts, overlaps = [], [], []
            try:
                if name in variants and name not in _UNCHECKED:
                    _check(pool, plans, issue)
                    drain()
                for i in range(args.warmup + args.repeats):
                    total, host, spans = _timed(streams, issue, marks)
                    drain()
                    if name.startswith("engine "):  # issue() returned once both landed
                        total = host
                    if i >= args.warmup:
                        totals.append(total)
                        hosts.append(host)
                        overlap = _overlap(spans)
                        if overlap is not None:
                            overlaps.append(overlap)
            except Exception as exc:  # one variant failing keeps the others
                torch.cuda.synchronize()
                drain()
                rows.append({"geometry": label, "variant": name, "error": repr(exc)})
                continue
            us = statistics.median(totals)
            moved = num_bytes * (1 if name in alone else 2)
            row = {
                "geometry": label, "variant": name, "blocks": args.blocks,
                "host_runs": args.host_runs,
                "descriptors": plans[_D2H][0].num_descriptors, "bytes": moved,
                "us": round(us, 1), "host_us": round(statistics.median(hosts), 1),
                "gbps": round(moved / us / 1e3, 2),
            }  # fmt: skip
            if name == "limit":
                limit_us = us
            elif name in variants and limit_us is not None:
                row["ratio"] = round(limit_us / us, 3)
                if overlaps:
                    row["overlap"] = round(statistics.median(overlaps), 3)
            if name == "auto":
                row["choice"] = f"d2h={names[_D2H]} h2d={names[_H2D]} first={choice.first.value}"
                row["model_us"] = round(choice.us, 1)
                row["staged_descriptors"] = list(staged_counts)
            rows.append(row)
        for engine in engines.values():
            engine.close()
    return rows


def _engines(driver: CopyDriver, staging_bytes: int) -> dict[str, Any]:
    """The engines ``cuda`` and ``auto`` (where they can be built) on the current device."""
    from kvmgr.transfer.cuda_engine import AutoEngine, CudaBatchEngine

    engines: dict[str, Any] = {"cuda": CudaBatchEngine(driver=driver)}
    try:
        engines["auto"] = AutoEngine(driver=driver, staging_bytes=staging_bytes)
    except Exception as exc:  # no kernel: the row says so
        print(json.dumps({"variant": "engine auto", "error": repr(exc)}))
    return engines


def _through(engine: Any, plans: dict[Direction, Any], counts: dict[Direction, Any]) -> Callable[[], None]:  # fmt: skip
    """Both plans through ``engine.submit`` as a step submits them (``plan_duplex`` first where
    the engine has it), returning once both futures resolved: the wall time a caller sees."""

    def issue() -> None:
        duplex = getattr(engine, "plan_duplex_plans", None)
        order = duplex(plans[_D2H][0], plans[_H2D][0]) if duplex is not None else (_D2H, _H2D)
        handles = [engine.submit(plans[d][0]) for d in order]
        for handle in handles:
            handle.future.result()

    return issue


def _device_parts(
    pool: CasePool,
    plans: dict[Direction, Any],
    move: KernelCopy,
    streams: dict[Direction, torch.cuda.Stream],
    keep: list[Any],
) -> dict[str, Callable[[], None]]:
    """``gather d2h``: the store's scattered GPU pages into a dense GPU buffer by the staged
    path's kernel; ``scatter h2d``: the load's from such a buffer (device to device only)."""
    rows: dict[str, Callable[[], None]] = {}
    for name, direction in (("gather d2h", _D2H), ("scatter h2d", _H2D)):
        _, src_ids, dst_ids = plans[direction]
        gpu_ids = src_ids if direction is _D2H else dst_ids
        n = len(gpu_ids)
        views = [torch.empty((n, t[0].numel()), dtype=torch.uint8, device="cuda") for t in pool.gpu]
        dense = KVLayout.from_tensors(views)
        gpu = pool.layouts["gpu"]
        slots = np.arange(n)
        plan = (
            build_plan(_D2H, gpu, dense, gpu_ids, slots)
            if direction is _D2H
            else build_plan(_H2D, dense, gpu, slots, gpu_ids)
        )

        def issue(plan: Any = plan, views: Any = views, direction: Direction = direction) -> None:
            issued = move.issue(plan, streams[direction])
            if issued.error is not None:
                raise issued.error
            keep.append(issued)  # its table slot goes back after the streams synchronized

        rows[name] = issue
    return rows


def _check(pool: CasePool, plans: dict[Direction, Any], issue: Callable[[], None]) -> None:
    """Poison both destinations, run the pair once, compare every page with its source.

    Raises:
        AssertionError: a page differs.
    """
    for direction in Direction:
        _, src_ids, dst_ids = plans[direction]
        dst = pool.host if direction is _D2H else pool.gpu
        for t in dst:
            t[torch.from_numpy(dst_ids).to(t.device)] = 0xA5
    torch.cuda.synchronize()
    issue()
    torch.cuda.synchronize()
    for direction in Direction:
        _, src_ids, dst_ids = plans[direction]
        src, dst = (pool.gpu, pool.host) if direction is _D2H else (pool.host, pool.gpu)
        for s, d in zip(src, dst):
            a = s[torch.from_numpy(src_ids).to(s.device)].cuda()
            b = d[torch.from_numpy(dst_ids).to(d.device)].cuda()
            if not torch.equal(a, b):
                raise AssertionError(f"{direction.value}: wrong bytes")
