"""The pieces of ``kvmgr bench duplex`` (private to ``kvmgr.bench``): the plans of one
geometry, the issue closures of every path and pair, the timing of one issue, the byte check.

Offers:
    Rig           streams, plans, copy paths and contiguous buffers of one geometry; ``one``,
                  ``both``, ``threaded``, ``contiguous`` build the issues the variants time
    timed         total, host and per-direction spans of one issue
    overlap       the share of the shorter direction's span spent while the other ran
    check         run a pair once over poisoned destinations and compare every page
    engines, through, device_parts   the engine rows and the staged path's device parts
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvmgr.bench.common import CasePool
from kvmgr.kernels.copy.row import KERNEL_AVAILABLE
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer.dma import DmaCopy
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.kernel import KernelCopy
from kvmgr.transfer.plan import Direction, build_plan
from kvmgr.transfer.staged import StagedCopy

__all__ = ["Rig", "check", "device_parts", "engines", "overlap", "through", "timed"]

_D2H, _H2D = Direction.D2H, Direction.H2D


class Rig:
    """What one geometry's variants issue: two streams (H2D at high priority), a store and a
    load plan over disjoint blocks, the copy paths (``dma``; ``kernel`` and ``staged`` where
    the kernel is available) and two contiguous buffers per direction for the limit.

    ``marks`` is filled by each issue (events right before and after it on its stream);
    ``keep`` holds the issued copies until ``drain`` releases them after a synchronize.
    """

    def __init__(self, pool: CasePool, args: argparse.Namespace, driver: CopyDriver) -> None:
        self.pool = pool
        self.streams = {_D2H: torch.cuda.Stream(priority=0), _H2D: torch.cuda.Stream(priority=-1)}
        self.plans = _plans(pool, args.blocks, np.random.default_rng(0), args.host_runs)
        self.num_bytes = self.plans[_D2H][0].num_bytes
        dma = DmaCopy(driver, "batch", 8192)
        # with its index: KernelCopy takes the paged path only for layouts on its own device
        # (a plain "cuda" device made every kernel row here use the descriptor kernel)
        self.device = torch.cuda.current_device()
        cuda = torch.device("cuda", self.device)
        self.kernel = KernelCopy(cuda, driver) if KERNEL_AVAILABLE else None
        self.issuers: dict[str, Any] = {"dma": dma}
        self.move: KernelCopy | None = None
        if self.kernel is not None:
            self.move = KernelCopy(cuda, driver, d2h_programs=32, h2d_programs=32)
            staged = StagedCopy(cuda, self.move, dma, staging_bytes=args.staging_mib << 20)
            self.issuers |= {"kernel": self.kernel, "staged": staged}
        self.keep: list[Any] = []
        self.marks: dict[Direction, tuple[Any, Any]] = {}
        # the limit: two contiguous copies of the same bytes, opposite directions
        n = self.num_bytes
        self._gpu_src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        self._gpu_dst = torch.empty_like(self._gpu_src)
        self._host_dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        self._host_src = torch.randint(0, 256, (n,), dtype=torch.uint8).pin_memory()

    def drain(self) -> None:
        """After a synchronize: the issued copies' table slots go back to their pool."""
        for issued in self.keep:
            if issued.release is not None:
                issued.release()
        self.keep.clear()

    def settle(self) -> None:
        """Wait for both streams, then ``drain`` (after an issue that raised)."""
        torch.cuda.synchronize()
        self.drain()

    def one(self, name: str, direction: Direction) -> Callable[[], None]:
        """Issue path ``name``'s copy of ``direction``'s plan on its stream."""

        def issue() -> None:
            stream = self.streams[direction]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # fmt: skip
            start.record(stream)
            issued = self.issuers[name].issue(self.plans[direction][0], stream)
            end.record(stream)
            self.marks[direction] = (start, end)
            if issued.error is not None:
                raise issued.error
            self.keep.append(issued)  # released by drain() after the streams synchronized

        return issue

    def both(self, first: tuple[str, Direction], second: tuple[str, Direction]) -> Callable[[], None]:  # fmt: skip
        """``first``'s issue, then ``second``'s, from this thread."""
        a, b = self.one(*first), self.one(*second)
        return lambda: (a(), b())

    def threaded(self) -> None:
        """Each direction's ``dma`` issue on its own host thread."""
        workers = [threading.Thread(target=self._on_thread(self.one("dma", d))) for d in Direction]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def _on_thread(self, issue: Callable[[], None]) -> Callable[[], None]:
        def target() -> None:
            torch.cuda.set_device(self.device)  # the context current on this thread too
            issue()

        return target

    def contiguous(self, direction: Direction | None) -> Callable[[], None]:
        """One contiguous copy of the plans' bytes in ``direction`` (``None``: both)."""

        def issue() -> None:
            if direction in (None, _D2H):
                with torch.cuda.stream(self.streams[_D2H]):
                    self._host_dst.copy_(self._gpu_src, non_blocking=True)
            if direction in (None, _H2D):
                with torch.cuda.stream(self.streams[_H2D]):
                    self._gpu_dst.copy_(self._host_src, non_blocking=True)

        return issue


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


def timed(
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


def overlap(spans: dict[Direction, tuple[float, float]]) -> float | None:
    if len(spans) < 2:
        return None
    (a0, a1), (b0, b1) = spans[_D2H], spans[_H2D]
    shorter = min(a1 - a0, b1 - b0)
    return max(0.0, min(a1, b1) - max(a0, b0)) / shorter if shorter > 0 else 0.0


def engines(driver: CopyDriver, staging_bytes: int) -> dict[str, Any]:
    """The engines ``cuda`` and ``auto`` (where they can be built) on the current device."""
    from kvmgr.transfer.cuda_engine import AutoEngine, CudaBatchEngine

    engines: dict[str, Any] = {"cuda": CudaBatchEngine(driver=driver)}
    try:
        engines["auto"] = AutoEngine(driver=driver, staging_bytes=staging_bytes)
    except Exception as exc:  # no kernel: the row says so
        print(json.dumps({"variant": "engine auto", "error": repr(exc)}))
    return engines


def through(engine: Any, plans: dict[Direction, Any], counts: dict[Direction, Any]) -> Callable[[], None]:  # fmt: skip
    """Both plans through ``engine.submit`` as a step submits them (``plan_duplex`` first where
    the engine has it), returning once both futures resolved: the wall time a caller sees."""

    def issue() -> None:
        duplex = getattr(engine, "plan_duplex_plans", None)
        order = duplex(plans[_D2H][0], plans[_H2D][0]) if duplex is not None else (_D2H, _H2D)
        handles = [engine.submit(plans[d][0]) for d in order]
        for handle in handles:
            handle.future.result()

    return issue


def device_parts(
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


def check(pool: CasePool, plans: dict[Direction, Any], issue: Callable[[], None]) -> None:
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
