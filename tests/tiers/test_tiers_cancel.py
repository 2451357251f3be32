"""Cancellation never lets a worker thread touch CPU blocks that were handed out again (issue 26).

A promote's scatter (and a demote's gather) of a batch over ``offload_bytes`` runs in a worker
thread. These tests cancel fetches, ``asyncio.wait_for``-bounded fetches, promotes and demotes at
random points, on the real disk tier (tmp_path files) and the real server (tests/tiers_server.py),
then reuse the CPU blocks at once and compare every byte afterwards: what the CPU tier serves and
what write-through published must be the bytes that were stored under each key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import threading
import time

import numpy as np
import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.testing import check_invariants
from kvmgr.tiers import DiskTier, SharedTier, TierBridge, TierNamespace

# 2 tensors of 64 KiB pages: 128 KiB a block, so a batch of 48 blocks (6 MiB) is scattered and
# gathered in a worker thread (TierBridge's offload_bytes is 1 MiB)
SHAPE = (64, 256)  # float32 [blocks, 64, 256]
PAGE = SHAPE[0] * SHAPE[1] * 4
NUM = 48
SLOW_S = 0.02  # an instrumented worker waits this long before it copies (a loaded machine)
STRAY_S = 0.05  # a stray worker (the bug) is done writing after this long


def _ns() -> TierNamespace:
    return TierNamespace(
        model="cancel",
        page_bytes=(PAGE, PAGE),
        dtype_names=("float32", "float32"),
        block_size=16,
        tenant_salt=b"cancel-tests",
    )


def _keys(n: int, tag: bytes) -> list[bytes]:
    return [
        hashlib.blake2b(tag + i.to_bytes(4, "little"), digest_size=16).digest() for i in range(n)
    ]


def _kv(seed: int, num_blocks: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, *SHAPE, generator=gen) for _ in range(2)]


async def _store(mgr: OffloadManager, ids: list[int], keys: list[bytes]) -> None:
    future = mgr.swap_out(ids, keys)
    await mgr.step()
    await future


async def _quiet(mgr: OffloadManager) -> None:
    """Wait until the background tier writes have landed, and a little more: a worker thread
    that outlived its cancelled call (the bug) finishes its writes within that time."""
    await mgr._tiers.drain(30.0)  # type: ignore[union-attr]
    await asyncio.sleep(STRAY_S)


class _Slow:
    """Wraps a bridge's ``_scatter``/``_gather`` (a test instrument): sets ``started`` when the
    worker begins, then waits ``SLOW_S`` before copying, as a loaded machine would."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.loop = asyncio.get_running_loop()
        self.started = asyncio.Event()
        self.busy = 0
        self.lock = threading.Lock()

    def __call__(self, *args) -> None:
        with self.lock:
            self.busy += 1
        self.loop.call_soon_threadsafe(self.started.set)
        try:
            time.sleep(SLOW_S)
            self.fn(*args)
        finally:
            with self.lock:
                self.busy -= 1


async def _cancel_at(coro, point: tuple[str, float], worker: _Slow) -> None:
    """Run ``coro`` and cancel it at ``point``: ``("time", s)`` cancels the task after ``s``
    seconds; ``("worker", s)`` ``s`` seconds after the worker thread started; ``("wait_for", s)``
    bounds it with ``asyncio.wait_for(coro, s)``. The cancellation is swallowed."""
    how, delay_s = point
    worker.started.clear()
    if how == "wait_for":
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(coro, delay_s)
        return
    task = asyncio.ensure_future(coro)
    if how == "worker":  # (a fetch that misses has no worker: then cancel it when it is done)
        started = asyncio.ensure_future(worker.started.wait())
        await asyncio.wait([task, started], return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
    await asyncio.sleep(delay_s)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _tier(kind: str, tmp_path, server) -> object:
    if kind == "disk":
        ns = _ns()
        return DiskTier(tmp_path / "tier.bin", slot_bytes=ns.blob_bytes, num_slots=4 * NUM)
    return SharedTier(server.url, deadline_s=10.0, single_tenant=True)


@pytest.fixture(params=["disk", "shared"])
def tier_kind(request) -> str:
    return request.param


@pytest.fixture
def maybe_server(tier_kind, request):
    if tier_kind == "shared":
        return request.getfixturevalue("tier_server")
    return None


def _points(rng: random.Random, call_s: float, tries: int) -> list[tuple[str, float]]:
    """Random cancellation points: a third at a random time of the call, a third a random
    moment after its worker started, a third ``wait_for`` budgets over the call."""
    kinds = ["time", "worker", "wait_for"]
    return [
        (kinds[i % 3], rng.uniform(0, SLOW_S) if i % 3 == 1 else rng.uniform(0, 1.2 * call_s))
        for i in range(tries)
    ]


@pytest.mark.asyncio
async def test_a_cancelled_fetch_never_serves_or_publishes_its_pages(
    tier_kind, maybe_server, tmp_path
) -> None:
    """Found by an operator pass (issue 26): the cancelled fetch's ``finally`` freed its CPU
    blocks while the scatter thread still wrote them; the next store got those blocks and 98-155
    of its 160 were served (and written through to the shared tier) with the fetch's pages."""
    rng = random.Random(f"fetch-{tier_kind}")
    tier = _tier(tier_kind, tmp_path, maybe_server)
    kv = _kv(1, 4 * NUM)
    config = ManagerConfig(num_cpu_blocks=NUM, tier_write_through=True, tier_write_back=False)
    try:
        async with OffloadManager(kv, config, tiers=[tier], tier_namespace=_ns()) as mgr:
            bridge = mgr._tiers.bridges[0]  # type: ignore[union-attr]
            worker = bridge._pages.scatter = _Slow(bridge._pages.scatter)  # type: ignore[method-assign]
            ids_a = mgr.allocate("a", NUM)
            keys_a = _keys(NUM, b"a")
            await _store(mgr, ids_a, keys_a)  # written through to the tier
            await _quiet(mgr)
            # one uncancelled fetch to learn how long a fetch takes here
            assert mgr.invalidate(keys_a) == NUM
            t0 = time.perf_counter()
            assert await mgr.fetch(keys_a) == NUM
            fetch_s = time.perf_counter() - t0
            for attempt, point in enumerate(_points(rng, fetch_s, 9)):
                mgr.invalidate(keys_a)  # A only in the lower tier
                keys_c = _keys(NUM, b"c%d" % attempt)
                ids_c = mgr.allocate(("c", attempt), NUM)
                for t in kv:  # C's KV: fresh random bytes in C's GPU blocks
                    t[ids_c] = torch.randn(NUM, *SHAPE)
                # cancel the fetch of A, then store C at once: C's store takes whatever CPU
                # blocks the cancelled fetch gave back
                await _cancel_at(mgr.fetch(keys_a), point, worker)
                mgr.invalidate(keys_a)  # what a fetch that got through staged: drop it
                await _store(mgr, ids_c, keys_c)
                check_invariants(mgr)
                await _quiet(mgr)
                # what the CPU tier serves for C is C's KV
                dst = mgr.allocate(("load", attempt), NUM)
                future = mgr.swap_in(keys_c, dst)
                await mgr.step()
                await future
                for t in kv:
                    assert torch.equal(t[dst], t[ids_c]), f"{point}: wrong KV served"
                # what write-through published under C's keys is C's KV
                probe = [torch.zeros(NUM, PAGE, dtype=torch.uint8) for _ in kv]
                assert (await TierBridge(probe, tier, _ns()).promote(keys_c, range(NUM))).all()
                for p, t in zip(probe, kv):
                    got = p.view(torch.float32).view(NUM, *SHAPE)
                    assert torch.equal(got, t[ids_c]), f"{point}: wrong KV published"
                assert mgr.invalidate(keys_c) == NUM
                mgr.free(("c", attempt))
                mgr.free(("load", attempt))
                check_invariants(mgr)
    finally:
        await tier.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("direction", ["demote", "promote"])
async def test_a_cancelled_bridge_call_returns_only_after_its_worker_let_go(
    tier_kind, maybe_server, tmp_path, direction
) -> None:
    """When a cancelled ``demote``/``promote`` (or one bounded by ``wait_for``) returns to its
    caller, no worker thread reads or writes its CPU blocks any more: the caller may reuse them
    at once. The blocks are overwritten right after every cancellation; afterwards every key
    reads back as a miss or as exactly the bytes that were demoted under it."""
    rng = random.Random(f"bridge-{tier_kind}-{direction}")
    tier = _tier(tier_kind, tmp_path, maybe_server)
    gen = torch.Generator().manual_seed(7)
    cpu = [torch.randint(0, 256, (2 * NUM, PAGE), dtype=torch.uint8, generator=gen) for _ in "kv"]
    bridge = TierBridge(cpu, tier, _ns())
    name = "gather" if direction == "demote" else "scatter"
    worker = _Slow(getattr(bridge._pages, name))
    setattr(bridge._pages, name, worker)
    try:
        t0 = time.perf_counter()
        warm = _keys(NUM, b"warm")
        assert (await bridge.demote(warm, np.arange(NUM))).all()
        assert (await bridge.promote(warm, np.arange(NUM, 2 * NUM))).all()
        call_s = (time.perf_counter() - t0) / 2
        expected: dict[bytes, list[np.ndarray]] = {}
        for attempt, point in enumerate(_points(rng, call_s, 9)):
            keys = _keys(NUM, b"%s-%d" % (direction.encode(), attempt))
            src = np.arange(NUM)
            before = [t.numpy()[src].copy() for t in cpu]
            if direction == "demote":
                call = bridge.demote(keys, src)
            else:
                assert (await bridge.demote(keys, src)).all()
                call = bridge.promote(keys, np.arange(NUM, 2 * NUM))
            await _cancel_at(call, point, worker)
            assert worker.busy == 0, f"{point}: a worker still touches the CPU blocks"
            for t in cpu:  # reuse the blocks at once
                t[:] = torch.randint(0, 256, t.shape, dtype=torch.uint8)
            for i, k in enumerate(keys):
                expected[k] = [b[i] for b in before]
        await asyncio.sleep(STRAY_S)  # let cancelled writes land (a write already sent may)
        keys = list(expected)
        probe = [torch.zeros(len(keys), PAGE, dtype=torch.uint8) for _ in "kv"]
        hit = await TierBridge(probe, tier, _ns()).promote(keys, np.arange(len(keys)))
        for i, key in enumerate(keys):
            if hit[i]:
                for p, want in zip(probe, expected[key]):
                    assert np.array_equal(p.numpy()[i], want), "a torn gather was published"
    finally:
        await tier.aclose()
