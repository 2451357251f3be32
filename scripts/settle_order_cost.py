"""What an exact settle would cost (issue 27, helper tidy): 512 one-block ``swap_out`` calls
into a full CPU tier (4 x 512 blocks, every round evicts 512) + ``step()`` + completion, 48
tensors, ``NullEngine``, per policy, with the batched settle (one eviction for the step's
shortfall) and with a call-by-call settle (each recorded call through the general path, in
call order: the order ARC and S3-FIFO need to evict what stores prepared at their calls evict;
``scripts/deferred_victims_probe.py``). One process, the two settles alternating round by round.

    PYTHONPATH=$PWD python3 scripts/settle_order_cost.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np
import torch

import kvmgr.scheduler.bookkeeping as bookkeeping
from kvmgr import ManagerConfig, OffloadManager
from kvmgr.bench._keys import FreshKeys
from kvmgr.scheduler import deferred
from kvmgr.scheduler import settle as settling
from kvmgr.testing import NullEngine

N = 512


def _call_by_call(pending: deferred.DeferredStores, stores: settling.Stores) -> list:
    if pending.fan is None:
        return []
    fan, ends, gpu_ids, keys = pending.take()
    return settling._one_by_one(stores, fan, ends, gpu_ids, keys)


SETTLES = {"batched": settling.settle, "call-by-call": _call_by_call}


async def _round(mgr: OffloadManager, held: list[int], fresh: FreshKeys, settle: object) -> float:
    bookkeeping.settle = settle  # type: ignore[assignment]
    keys = fresh.take(N)
    t0 = time.perf_counter()
    last = [mgr.swap_out(held[i : i + 1], keys[i : i + 1]) for i in range(N)][-1]
    await mgr.step()
    await last
    return (time.perf_counter() - t0) * 1e6


async def main(rounds: int) -> None:
    for policy in ("lru", "arc", "s3fifo"):
        kv = [torch.empty(2 * N, 256, dtype=torch.uint8) for _ in range(48)]
        config = ManagerConfig(num_cpu_blocks=4 * N, policy=policy)
        async with OffloadManager(kv, config, engine=NullEngine()) as mgr:
            held = mgr.allocate("bench", N)
            fresh, times = FreshKeys(), {name: [] for name in SETTLES}
            for i in range(rounds + 20):
                order = list(SETTLES) if i % 2 == 0 else list(SETTLES)[::-1]
                for name in order:
                    us = await _round(mgr, held, fresh, SETTLES[name])
                    if i >= 20:
                        times[name].append(us)
        p50 = {name: statistics.median(t) for name, t in times.items()}
        ratio = statistics.median(np.array(times["call-by-call"]) / np.array(times["batched"]))
        print(f"{policy:7s} batched p50 {p50['batched']:8.0f} us   call-by-call p50 "
              f"{p50['call-by-call']:8.0f} us   ratio (paired median) {ratio:.2f}x")  # fmt: skip
    bookkeeping.settle = settling.settle


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    asyncio.run(main(parser.parse_args().rounds))
