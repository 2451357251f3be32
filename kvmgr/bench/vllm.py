"""``kvmgr bench vllm``: scheduler-side host cost, kvmgr's manager against vLLM 0.33's, same calls.

One process, no GPU, no copy: kvmgr's ``OffloadManager`` facade with ``kvmgr.testing.NullEngine``
(every batch completes at once) against vLLM's ``CPUOffloadingManager`` (the scheduler side of
its CPU offloading; the worker's copies are not part of it), both LRU and ARC, the CPU tier of
both the same number of blocks; and kvmgr's ``KvmgrOffloadingManager`` (API ``backend``: the
scheduler side of ``KvmgrOffloadingSpec``, issue 22 part 3) driven through exactly vLLM's calls.
One *step* is the calls a scheduler step makes and their completion:

- ``store 512 x 1``: 512 one-block stores into a full tier (each step evicts 512 blocks).
  kvmgr batched: one ``store_many`` + ``step()`` + await; kvmgr per-call: 512 ``swap_out`` +
  ``step()`` + await; vLLM: 512 ``prepare_store([key])`` then 512 ``complete_store``.
- ``lookup+load 32 x 64``: 32 requests whose 64-block prefixes are resident: kvmgr ``lookup`` +
  ``swap_in`` each, ``step()``, await; vLLM 64 ``lookup`` calls + ``prepare_load`` each, then
  ``complete_load`` each.
- ``mixed 64 x 8 + 16 x 16``: 64 eight-block stores into a full tier plus 16 sixteen-block loads
  of resident prefixes, per call on both sides.

vLLM's requests get a ``ReqContext`` with the key positions the scheduler would have set (made
outside the timed region, as the scheduler makes them when a request arrives). Each scenario
starts from new managers on every side (vLLM's and kvmgr's, each filled the same way), and a
full garbage collection after the fills; its variants then take turns step by step, the order
rotated by one each step (no variant always runs first or right after another's garbage), so
load from other processes and the collector hit them alike. Reported: p50 / p99 microseconds
per step over ``--steps`` steps after 10 warm-up steps, with the garbage collector on, and the
ratio kvmgr / vLLM of the p50s (below 1: kvmgr is cheaper). The JSON names the kvmgr package
measured (its path): a script run from a worktree imports the editable install otherwise.
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
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import torch

import kvmgr
from kvmgr.bench._keys import FreshKeys
from kvmgr.bench._vllm_side import vllm_steps
from kvmgr.config import ManagerConfig
from kvmgr.manager import OffloadManager
from kvmgr.testing import NullEngine

__all__ = ["add_arguments", "run"]

NUM_TENSORS = 48
PAGE_BYTES = 64
NUM_CPU_BLOCKS = 4096
NUM_GPU_BLOCKS = 512 + 32 * 64  #: store blocks, then one distinct block per loaded block
WARMUP = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=200, help="timed steps per variant")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=("lru", "arc"),
        default=("lru", "arc"),
        help="the eviction policies measured on both sides",
    )


# -- kvmgr's side ---------------------------------------------------------------------------------


async def _kvmgr_steps(policy: str, scenario: str, api: str) -> AsyncIterator[float]:
    """Seconds of each step of kvmgr's facade (calls + ``step()`` + completion), endlessly."""
    kv = [torch.empty(NUM_GPU_BLOCKS, PAGE_BYTES, dtype=torch.uint8) for _ in range(NUM_TENSORS)]
    mgr = OffloadManager(
        kv, ManagerConfig(num_cpu_blocks=NUM_CPU_BLOCKS, policy=policy), engine=NullEngine()
    )
    fresh = FreshKeys()
    async with mgr:
        held = mgr.allocate("bench", NUM_GPU_BLOCKS)
        fill = np.array(held[:64], dtype=np.int64)
        hot = [fresh.take(64) for _ in range(NUM_CPU_BLOCKS // 64)]
        for chain in hot:  # a full tier
            fut = mgr.store_many(fill, chain)
            await mgr.step()
            await fut
        store_ids, load_ids = held[:512], held[512:]
        while True:
            t0 = time.perf_counter()
            last: Any = None
            if scenario == "store 512 x 1":
                keys = fresh.take(512)
                if api == "batched":
                    last = mgr.store_many(np.asarray(store_ids, dtype=np.int64), keys)
                else:
                    for b, k in zip(store_ids, keys):
                        last = mgr.swap_out([b], [k])
            elif scenario == "lookup+load 32 x 64":
                for r, chain in enumerate(hot[-32:]):
                    n = mgr.lookup(chain)
                    last = mgr.swap_in(chain[:n], load_ids[r * 64 : r * 64 + n])
            else:  # mixed: 64 eight-block stores + 16 sixteen-block loads
                keys = fresh.take(512)
                for r in range(64):
                    last = mgr.swap_out(store_ids[r * 8 : r * 8 + 8], keys[r * 8 : r * 8 + 8])
                for r, chain in enumerate(hot[-16:]):
                    n = mgr.lookup(chain[:16])
                    last = mgr.swap_in(chain[:n], load_ids[r * 16 : r * 16 + n])
            await mgr.step()
            await last
            yield time.perf_counter() - t0


SCENARIOS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("store 512 x 1", ("backend", "batched", "per-call")),
    ("lookup+load 32 x 64", ("backend", "per-call")),
    ("mixed 64 x 8 + 16 x 16", ("backend", "per-call")),
)


def _summary(samples: list[float]) -> dict[str, float]:
    us = np.array(samples) * 1e6
    return {"p50_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99))}


async def _interleaved(
    policy: str, scenario: str, apis: tuple[str, ...], steps: int
) -> dict[str, list[float]]:
    """Step vLLM's manager and each kvmgr variant in turn (new managers for this scenario, the
    order rotated each step), so machine noise and the collector hit all alike."""
    sync = {"vllm": vllm_steps(policy, scenario, NUM_CPU_BLOCKS)}
    if "backend" in apis:
        sync["backend"] = vllm_steps(policy, scenario, NUM_CPU_BLOCKS, backend=True)
    ours = {api: _kvmgr_steps(policy, scenario, api) for api in apis if api != "backend"}
    for gen in sync.values():  # each side's fill and a first step, not counted
        next(gen)
    for agen in ours.values():
        await agen.__anext__()
    names = list(sync) + list(ours)
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()  # the fills' garbage: collected now, not in some variant's timed step
    try:
        for i in range(steps + WARMUP):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                gen = sync.get(name)
                seconds = next(gen) if gen is not None else await ours[name].__anext__()
                if i >= WARMUP:
                    samples[name].append(seconds)
    finally:
        for gen in sync.values():
            gen.close()
        for agen in ours.values():
            await agen.aclose()
    return samples


def measure(steps: int, policies: Sequence[str] = ("lru", "arc")) -> list[dict[str, Any]]:
    """Every scenario and API for each policy; one dict per row (see the module docstring)."""
    rows = []
    for policy in policies:
        for scenario, apis in SCENARIOS:
            samples = asyncio.run(_interleaved(policy, scenario, apis, steps))
            theirs = _summary(samples["vllm"])
            for api in apis:
                ours = _summary(samples[api])
                rows.append(
                    {
                        "policy": policy,
                        "scenario": scenario,
                        "api": api,
                        "kvmgr_p50_us": ours["p50_us"],
                        "kvmgr_p99_us": ours["p99_us"],
                        "vllm_p50_us": theirs["p50_us"],
                        "vllm_p99_us": theirs["p99_us"],
                        "ratio": ours["p50_us"] / theirs["p50_us"],
                    }
                )
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| policy | scenario | kvmgr API | kvmgr p50 / p99 us | vLLM p50 / p99 us | kvmgr / vLLM |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['scenario']} | {r['api']} | {r['kvmgr_p50_us']:.0f} / "
            f"{r['kvmgr_p99_us']:.0f} | {r['vllm_p50_us']:.0f} / {r['vllm_p99_us']:.0f} | "
            f"{r['ratio']:.2f}x |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        print("kvmgr bench vllm: error: --steps must be >= 1", file=sys.stderr)
        return 2
    try:
        import vllm
    except ImportError as exc:
        print(f"kvmgr bench vllm: error: needs vLLM 0.33 (kvmgr[vllm]): {exc}", file=sys.stderr)
        return 2
    rows = measure(args.steps, args.policies)
    print(_table(rows))
    if args.json:
        doc: dict[str, Any] = {
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "vllm": vllm.__version__,
            "kvmgr": os.path.dirname(kvmgr.__file__),
            "torch": torch.__version__,
            "num_cpu_blocks": NUM_CPU_BLOCKS,
            "steps": args.steps,
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0
