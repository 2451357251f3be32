"""``kvmgr bench host``: the manager's own host path, on any machine (no GPU, no copy).

Drives an ``OffloadManager`` over 48 CPU "KV tensors" with ``kvmgr.testing.NullEngine`` (every
batch completes at once, nothing is copied), so what is timed is kvmgr's Python: validation,
bookkeeping, plan building, submission and completion.

Scenarios (requests x blocks per request): 512 x 1, 512 x 4, 64 x 8, each as stores and loads,
each through the per-call API (``swap_out``/``swap_in``, one call per request) and the batched
API (``store_many``/``load_many``, one call for all requests). One *round* = the calls + one
``step()`` + completion (until every future resolved). Reported per round, in microseconds:
min / median / p99 of the whole round and the median of each phase, over ``--rounds`` rounds
with the garbage collector ON, with a CPU tier large enough that nothing is evicted; then a
steady-state run of ``--steps`` rounds of 512 one-block stores into a full CPU tier (every round
evicts 512 blocks through the policy), with the full (generation 2) collections seen during it
and the GC-tracked objects each queued call keeps alive.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import platform
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from kvmgr.bench._keys import FreshKeys
from kvmgr.bench._options import positive_int
from kvmgr.config import ManagerConfig
from kvmgr.manager import OffloadManager
from kvmgr.testing import NullEngine

__all__ = ["add_arguments", "run"]

NUM_TENSORS = 48
PAGE_BYTES = 64  #: tiny pages: nothing is copied, only descriptors are built
SCENARIOS = ((512, 1), (512, 4), (64, 8))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=positive_int, default=300, help="timed rounds per variant")
    parser.add_argument(
        "--steps",
        type=int,
        default=2000,
        help="rounds of the steady-state GC run (2000 or more reach the steady state)",
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


async def _round(
    mgr: OffloadManager, kind: str, api: str, reqs: int, per: int, keys: list[bytes], ids: Any
) -> tuple[float, float, float]:
    """One round; returns (calls, step, completion) seconds."""
    t0 = time.perf_counter()
    if api == "per-call":
        futures = []
        call = mgr.swap_out if kind == "store" else mgr.swap_in
        for r in range(reqs):
            chunk_ids, chunk_keys = ids[r * per : (r + 1) * per], keys[r * per : (r + 1) * per]
            if kind == "store":
                futures.append(call(chunk_ids, chunk_keys))
            else:
                futures.append(call(chunk_keys, chunk_ids))
        last = futures[-1]
    else:
        last = mgr.store_many(ids, keys) if kind == "store" else mgr.load_many(keys, ids)
    t1 = time.perf_counter()
    await mgr.step()
    t2 = time.perf_counter()
    await last
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def _manager(num_gpu_blocks: int, num_cpu_blocks: int) -> tuple[OffloadManager, list[torch.Tensor]]:
    kv = [torch.empty(num_gpu_blocks, PAGE_BYTES, dtype=torch.uint8) for _ in range(NUM_TENSORS)]
    config = ManagerConfig(num_cpu_blocks=num_cpu_blocks)
    return OffloadManager(kv, config, engine=NullEngine()), kv


async def _variant(kind: str, api: str, reqs: int, per: int, rounds: int) -> dict[str, Any]:
    n = reqs * per
    mgr, _kv = _manager(2 * n, (rounds + 10) * n)  # room for every round: no eviction
    async with mgr:
        held = mgr.allocate("bench", 2 * n)
        src = held[:n] if api == "per-call" else np.array(held[:n], dtype=np.int64)
        dst = held[n:] if api == "per-call" else np.array(held[n:], dtype=np.int64)
        fresh = FreshKeys()
        samples = []
        for i in range(rounds + 10):  # 10 warm-up rounds
            keys = fresh.take(n)
            if kind == "store":
                sample = await _round(mgr, "store", api, reqs, per, keys, src)
            else:
                await _round(mgr, "store", "batched", 1, n, keys, np.asarray(src))
                sample = await _round(mgr, "load", api, reqs, per, keys, dst)
            if i >= 10:
                samples.append(sample)
    arr = np.array(samples) * 1e6
    total = arr.sum(axis=1)
    return {
        "kind": kind,
        "api": api,
        "requests": reqs,
        "blocks_per_request": per,
        "round_us_min": float(total.min()),
        "round_us_p50": float(np.median(total)),
        "round_us_p99": float(np.percentile(total, 99)),
        "calls_us_p50": float(np.median(arr[:, 0])),
        "step_us_p50": float(np.median(arr[:, 1])),
        "completion_us_p50": float(np.median(arr[:, 2])),
    }


async def _steady(api: str, steps: int) -> dict[str, Any]:
    """``steps`` rounds of 512 one-block stores with the collector on: step time and GC."""
    reqs, per = 512, 1
    n = reqs * per
    mgr, _kv = _manager(n, 4 * n)  # the CPU tier fills up: every round evicts n blocks
    async with mgr:
        held = mgr.allocate("bench", n)
        ids: Any = held if api == "per-call" else np.array(held, dtype=np.int64)
        fresh = FreshKeys()
        for _ in range(20):
            await _round(mgr, "store", api, reqs, per, fresh.take(n), ids)
        gc.collect()
        rounds, steps_s = [], []
        with _full_collections() as full:
            for _ in range(steps):
                keys = fresh.take(n)
                calls_s, step_s, done_s = await _round(mgr, "store", api, reqs, per, keys, ids)
                rounds.append(calls_s + step_s + done_s)
                steps_s.append(step_s)
        tracked = await _tracked(mgr, api, fresh, ids)
    r, s = np.array(rounds) * 1e6, np.array(steps_s) * 1e6
    return {
        "api": api,
        "steps": steps,
        "round_us_p50": float(np.median(r)),
        "round_us_p99": float(np.percentile(r, 99)),
        "round_us_mean": float(r.mean()),
        "step_us_p50": float(np.median(s)),
        "step_us_p99": float(np.percentile(s, 99)),
        "full_collections": full[0],
        "gc_tracked_per_queued_call": tracked,
    }


@contextlib.contextmanager
def _full_collections() -> Iterator[list[int]]:
    """``[count]`` of the full (generation 2) collections that start inside the block."""
    full = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full[0] += 1

    gc.callbacks.append(on_gc)
    try:
        yield full
    finally:
        gc.callbacks.remove(on_gc)


async def _tracked(mgr: OffloadManager, api: str, fresh: FreshKeys, ids: Any) -> float:
    """GC-tracked objects kept alive per queued call (512 one-block calls, or one batch)."""
    keys = fresh.take(len(ids))
    gc.collect()
    before = len(gc.get_objects())
    if api == "per-call":
        futures = [mgr.swap_out([b], [k]) for b, k in zip(ids, keys)]
        calls = len(futures)
    else:
        futures = [mgr.store_many(ids, keys)]
        calls = 1
    gc.collect()
    alive = len(gc.get_objects()) - before
    await mgr.step()
    await futures[-1]
    del futures
    return alive / calls


def _table(results: list[dict[str, Any]], steady: list[dict[str, Any]]) -> str:
    lines = [
        "| scenario | API | round min / p50 / p99 us | calls p50 | step p50 | completion p50 |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        scen = f"{r['kind']} {r['requests']} x {r['blocks_per_request']}"
        lines.append(
            f"| {scen} | {r['api']} | {r['round_us_min']:.0f} / {r['round_us_p50']:.0f} / "
            f"{r['round_us_p99']:.0f} | {r['calls_us_p50']:.0f} | {r['step_us_p50']:.0f} | "
            f"{r['completion_us_p50']:.0f} |"
        )
    lines += [
        "",
        "| steady state, 512 x 1 stores | round p50 / p99 / mean us | step() p50 / p99 us | "
        "full GCs | GC objects per queued call |",
        "|---|---|---|---|---|",
    ]
    for s in steady:
        lines.append(
            f"| {s['api']}, {s['steps']} rounds | {s['round_us_p50']:.0f} / "
            f"{s['round_us_p99']:.0f} / {s['round_us_mean']:.0f} | {s['step_us_p50']:.0f} / "
            f"{s['step_us_p99']:.0f} | {s['full_collections']} | "
            f"{s['gc_tracked_per_queued_call']:.1f} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.steps < 1:
        print("kvmgr bench host: error: --rounds and --steps must be >= 1", file=sys.stderr)
        return 2
    results: list[dict[str, Any]] = []
    runner: Callable[[Any], Any] = asyncio.run
    for kind in ("store", "load"):
        for reqs, per in SCENARIOS:
            for api in ("per-call", "batched"):
                results.append(runner(_variant(kind, api, reqs, per, args.rounds)))
    steady = [runner(_steady(api, args.steps)) for api in ("per-call", "batched")]
    print(_table(results, steady))
    if args.json:
        doc = {
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "numpy": np.__version__,
            "torch": torch.__version__,
            "gc_thresholds": gc.get_threshold(),
            "tensors": NUM_TENSORS,
            "scenarios": results,
            "steady": steady,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0
