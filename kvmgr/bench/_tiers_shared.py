"""``kvmgr bench tiers``: the shared tier against its zero-copy floor, and a cluster against one
server (private to ``kvmgr.bench.tiers``).

Offers:
    Pages             one ``HostKVPool`` of random pages: ``batch`` source and ``batch``
                      destination blocks, and their page views
    bench_floor       SharedTier (through ``TierBridge``) vs ``FloorClient``, interleaved
    bench_cluster     SharedTier on a cluster vs on one server, interleaved

Each round times, in turn, every variant's store of one batch of fresh keys and then every
variant's load of it back into the destination blocks, so the variants see the same machine.
Time per variant and direction = the median over ``rounds`` (after one warm-up round); GB/s =
``batch * payload_bytes / median``; ratio = floor (or one server) median / tier (or cluster)
median. Loaded bytes are compared with the source blocks after every load.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch

from kvmgr.bench._floor import FloorClient
from kvmgr.pool.host_pool import HostKVPool
from kvmgr.tiers import SharedTier, TierBridge, TierNamespace

__all__ = ["Pages", "bench_cluster", "bench_floor", "timed_rounds"]

Step = Callable[[list[bytes]], Awaitable[bool]]


class Pages:
    """Random CPU-tier pages of one case: blocks ``[0, batch)`` are stored, ``[batch, 2 batch)``
    receive the loads."""

    def __init__(self, namespace: TierNamespace, batch: int, seed: int = 0) -> None:
        self.pool = HostKVPool(
            namespace.page_bytes, 2 * batch, lambda n: torch.empty(n, dtype=torch.uint8)
        )
        gen = torch.Generator().manual_seed(seed)
        self.pool.region.copy_(
            torch.randint(0, 256, (self.pool.num_bytes,), dtype=torch.uint8, generator=gen)
        )
        self.batch = batch
        arrays = [t.numpy() for t in self.pool.tensors]
        self.views = [[a[b] for a in arrays] for b in range(2 * batch)]

    def equal(self) -> bool:
        """Destination blocks hold the source blocks' bytes; then poison them again."""
        same = all(torch.equal(t[: self.batch], t[self.batch :]) for t in self.pool.tensors)
        for t in self.pool.tensors:
            t[self.batch :] = 0xA5
        return same


async def timed_rounds(
    variants: dict[str, tuple[Step, Step]],
    rounds: int,
    pages: Pages,
    tag: str,
    cleanup: Callable[[list[bytes]], Awaitable[None]],
) -> tuple[dict[str, list[float]], bool]:
    """Per variant and direction (``"name/store"``, ``"name/load"``), the seconds of each round;
    and whether every load gave the source bytes. ``cleanup`` gets every key of a round after
    it (untimed: the server's memory stays one round's worth)."""
    times: dict[str, list[float]] = {}
    ok = True
    for r in range(rounds + 1):
        keys = {name: [b"%s-%s-%d-%d" % (tag.encode(), name.encode(), r, i)
                       for i in range(pages.batch)] for name in variants}  # fmt: skip
        for direction, index in (("store", 0), ("load", 1)):
            for name, steps in variants.items():
                t0 = time.perf_counter()
                done = await steps[index](keys[name])
                seconds = time.perf_counter() - t0
                ok &= done and (index == 0 or pages.equal())
                if r:
                    times.setdefault(f"{name}/{direction}", []).append(seconds)
        await cleanup([k for ks in keys.values() for k in ks])
    return times, ok


def _rows(times: dict[str, list[float]], case: str, batch: int, payload: int, tier: str,
          ceiling: str) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    for direction in ("store", "load"):
        ours = statistics.median(times[f"{tier}/{direction}"])
        base = statistics.median(times[f"{ceiling}/{direction}"])
        rows.append({
            "case": case, "batch_blocks": batch, "direction": direction, "tier": tier,
            "gbps": batch * payload / ours / 1e9, "p50_ms": ours * 1e3,
            "ceiling": ceiling, "ceiling_gbps": batch * payload / base / 1e9,
            "ratio": base / ours,
        })  # fmt: skip
    return rows


def _bridge_steps(bridge: TierBridge, pages: Pages) -> tuple[Step, Step]:
    batch = pages.batch

    async def store(keys: list[bytes]) -> bool:
        return bool((await bridge.demote(keys, np.arange(batch))).all())

    async def load(keys: list[bytes]) -> bool:
        return bool((await bridge.promote(keys, np.arange(batch, 2 * batch))).all())

    return store, load


def _floor_steps(floor: FloorClient, pages: Pages) -> tuple[Step, Step]:
    batch = pages.batch
    sums = np.zeros((batch, 16), dtype=np.uint8)
    src, dst = pages.views[:batch], pages.views[batch:]

    async def store(keys: list[bytes]) -> bool:
        await asyncio.to_thread(floor.mset, keys, src, sums)
        return True

    async def load(keys: list[bytes]) -> bool:
        return await asyncio.to_thread(floor.mget, keys, dst, sums) == batch

    return store, load


async def bench_floor(
    case: str, namespace: TierNamespace, batch: int, url: str, address: tuple[str, int],
    rounds: int,
) -> tuple[list[dict[str, Any]], bool]:  # fmt: skip
    """Rows ``tier=shared`` against ``ceiling=floor`` for one case and batch size."""
    pages = Pages(namespace, batch)
    tier = SharedTier(url, deadline_s=120.0, single_tenant=True)
    floor = FloorClient(*address)

    async def flush(_keys: list[bytes]) -> None:
        await asyncio.to_thread(floor.flush)

    try:
        floor.flush()
        variants = {
            "shared": _bridge_steps(TierBridge(pages.pool.tensors, tier, namespace), pages),
            "floor": _floor_steps(floor, pages),
        }
        times, ok = await timed_rounds(variants, rounds, pages, f"{case}-{batch}", flush)
    finally:
        floor.close()
        await tier.aclose()
    return _rows(times, case, batch, namespace.payload_bytes, "shared", "floor"), ok


async def bench_cluster(
    case: str, namespace: TierNamespace, batch: int, single_url: str, cluster_url: str,
    rounds: int,
) -> tuple[list[dict[str, Any]], bool]:  # fmt: skip
    """Rows ``tier=cluster`` against ``ceiling=one server`` for one case and batch size."""
    pages = Pages(namespace, batch)
    single = SharedTier(single_url, deadline_s=120.0, single_tenant=True)
    cluster = SharedTier(cluster_url, deadline_s=120.0, single_tenant=True)
    try:
        variants = {
            "cluster": _bridge_steps(TierBridge(pages.pool.tensors, cluster, namespace), pages),
            "one server": _bridge_steps(TierBridge(pages.pool.tensors, single, namespace), pages),
        }

        async def delete(keys: list[bytes]) -> None:
            stored = namespace.stored_keys(keys)
            await single.delete_many(stored)
            await cluster.delete_many(stored)

        times, ok = await timed_rounds(variants, rounds, pages, f"c-{case}-{batch}", delete)
    finally:
        await single.aclose()
        await cluster.aclose()
    return _rows(times, case, batch, namespace.payload_bytes, "cluster", "one server"), ok
