"""The interference half of ``kvmgr bench swap-kernel``: a matmul loop on the compute stream
while an engine copies (private to ``kvmgr.bench.swap_kernel``, whose module docstring describes
the windows, the gate and the figures).

Offers:
    interference_rows   the rows of one case: per busy variant, copy GB/s alone and during the
                        loop, the loop's slowdown and how much of it the copies covered
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvmgr.bench.common import CopyCase, Variant, time_issue

__all__ = ["interference_rows"]

_Window = dict[str, Any]  # what _Gate.window measures


def interference_rows(
    case: CopyCase, columns: dict[str, Variant], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Matmul slowdown and copy GB/s for each column (module docstring)."""
    n = args.matmul
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    out = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    compute = torch.cuda.Stream()

    def matmuls() -> None:
        with torch.cuda.stream(compute):
            for _ in range(args.matmuls):
                torch.matmul(a, b, out=out)

    gate = _Gate(_sleep_rate(), compute, case.stream)
    time_issue(matmuls, compute, argparse.Namespace(warmup=2, repeats=1))  # cuBLAS, clocks
    alone = gate.window(20_000.0, matmuls, None, 0)
    rows = []
    for name, variant in columns.items():
        count, runs = _windows(gate, variant(case), matmuls, alone, args.interference_repeats)
        rows.append(_interference_row(name, case, count, runs))
    return rows


def _windows(
    gate: _Gate,
    issue: Callable[[], None],
    matmuls: Callable[[], None],
    alone: _Window,
    repeats: int,
) -> tuple[int, list[tuple[_Window, _Window, _Window]]]:
    """One column's copies per window (enough to outlast the matmuls) and, per repeat, the
    windows of the copies alone, the matmuls alone and both."""
    t0 = time.perf_counter()
    issue()  # warm-up (kernel compile, staging blocks), timed on the host
    torch.cuda.synchronize()
    issue_us = (time.perf_counter() - t0) * 1e6
    # The gate covers the matmul loop's enqueue and the first copy's issue; later copies
    # are issued back to back, as an engine does (the driver may block a long enqueue).
    gate_us = 20_000.0 + 2.0 * (alone["enqueue_us"] + issue_us)
    probe = gate.window(gate_us, None, issue, 2)
    copy_us = max(probe["ends_us"][-1] - probe["copy_start_us"], 1.0) / 2
    count = math.ceil(2.0 * alone["matmul_us"] / copy_us) + 1
    runs: list[tuple[_Window, _Window, _Window]] = []
    for r in range(repeats):
        copies = gate.window(gate_us, None, issue, count)
        if r % 2 == 0:
            matmul = gate.window(gate_us, matmuls, None, 0)
            both = gate.window(gate_us, matmuls, issue, count)
        else:  # the other order, so drift between the pair's windows cancels over repeats
            both = gate.window(gate_us, matmuls, issue, count)
            matmul = gate.window(gate_us, matmuls, None, 0)
        runs.append((copies, matmul, both))
    return count, runs


def _interference_row(
    name: str, case: CopyCase, count: int, runs: list[tuple[_Window, _Window, _Window]]
) -> dict[str, Any]:
    """One table row from ``(copies alone, matmuls alone, both)`` windows per repeat."""
    num_bytes = case.plan.num_bytes
    alone_gbps, during_gbps, slowdowns, covered, alone_us, during_us = [], [], [], [], [], []
    for copies, matmul, both in runs:
        span = copies["ends_us"][-1] - copies["copy_start_us"]
        alone_gbps.append(count * num_bytes / max(span, 1e-3) / 1e3)
        window = both["matmul_us"]
        inside = [t for t in both["ends_us"] if t <= window] or both["ends_us"][:1]
        span = inside[-1] - both["copy_start_us"]
        during_gbps.append(len(inside) * num_bytes / max(span, 1e-3) / 1e3)
        covered.append(100.0 * min(both["ends_us"][-1] / window, 1.0))
        alone_us.append(matmul["matmul_us"])
        during_us.append(window)
        slowdowns.append(100.0 * (window / matmul["matmul_us"] - 1.0))
    return {
        "variant": name,
        "direction": case.direction.value,
        "copies": count,
        "copy_gbps_alone": statistics.median(alone_gbps),
        "copy_gbps_during": statistics.median(during_gbps),
        "matmul_us_alone": statistics.median(alone_us),
        "matmul_us_during": statistics.median(during_us),
        "slowdown_pct": statistics.median(slowdowns),
        "slowdown_pct_min": min(slowdowns),
        "slowdown_pct_max": max(slowdowns),
        "covered_pct": min(covered),
        "gate_ok": all(w["gate_ok"] for run in runs for w in run),
    }


class _Gate:
    """Runs gated windows: a sleep kernel on a side stream holds the compute and copy streams
    until the host has enqueued the matmul loop and the first copy, so both start together."""

    def __init__(
        self, cycles_per_us: float, compute: torch.cuda.Stream, copy: torch.cuda.Stream
    ) -> None:
        self.cycles_per_us, self.compute, self.copy = cycles_per_us, compute, copy
        self.side = torch.cuda.Stream()

    def window(
        self,
        gate_us: float,
        matmuls: Callable[[], None] | None,
        issue: Callable[[], None] | None,
        count: int,
    ) -> dict[str, Any]:
        """One window: the matmul loop (if given) on the compute stream and ``count`` copies on
        the copy stream, issued back to back. Times in us from the gate opening (the matmul
        window's start); ``gate_ok``: the matmuls and the first copy were enqueued in time."""
        opened = torch.cuda.Event()
        t0 = time.perf_counter()
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(int(gate_us * self.cycles_per_us))
            opened.record(self.side)
        self.compute.wait_event(opened)
        self.copy.wait_event(opened)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 3)]
        events[0].record(self.compute)
        if matmuls is not None:
            matmuls()
        events[1].record(self.compute)
        enqueued = time.perf_counter()
        events[2].record(self.copy)
        for i, end in enumerate(events[3:]):
            assert issue is not None
            issue()
            end.record(self.copy)
            if i == 0:
                enqueued = time.perf_counter()
        in_time = (enqueued - t0) * 1e6 < gate_us
        torch.cuda.synchronize()
        return {
            "matmul_us": events[0].elapsed_time(events[1]) * 1e3,
            "copy_start_us": events[0].elapsed_time(events[2]) * 1e3,
            "ends_us": [events[0].elapsed_time(e) * 1e3 for e in events[3:]],
            "enqueue_us": (enqueued - t0) * 1e6,
            "gate_ok": in_time,
        }


def _sleep_rate() -> float:
    """``torch.cuda._sleep`` cycles per microsecond on this GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return float(10_000_000 / (start.elapsed_time(end) * 1e3))
