"""The store and eviction fast paths against the general paths, through the public API
(newuser12): one random program of ``store_many`` (keys all new, overlapping, repeated, with
parents, reversed ids), lookups + ``load_many``, ``invalidate``, ``clear``, ``touch`` and
``free`` runs twice, once as shipped and once with ``fresh_store.add_new``, ``BlockLru``'s
``_leading_run`` and ``_collect_leaves`` (the plain loop of ``_collect`` instead), the C
``sort_pairs`` and kvmgr's C index passes (``_index_c``) turned off; every step's snapshot
(keys, blocks, states, parents, policy keys), KV events, store results and errors must be
equal."""

from __future__ import annotations

import hashlib
import itertools
import random
from typing import Any

import numpy as np
import pytest
import torch

import kvmgr._keys as keys_module
import kvmgr.scheduler.block_lru as block_lru
import kvmgr.scheduler.gpu_blocks as gpu_blocks
import kvmgr.scheduler.key_index as key_index
import kvmgr.scheduler.lru_victims as lru_victims
import kvmgr.scheduler.store as store
import kvmgr.transfer._runs as runs
from kvmgr import ManagerConfig, OffloadManager
from kvmgr.errors import KVMgrError
from kvmgr.testing import NullEngine, check_invariants


def _record(mgr: OffloadManager, out: list[Any]) -> None:
    s = mgr.snapshot()
    out.append(
        (
            sorted((k, repr(v)) for k, v in s.keys.items()),
            tuple(map(int, s.cpu_states)),
            sorted(s.cpu_allocated),
            sorted(s.key_parents.items()),
            sorted(s.policy_keys),
            [repr(e) for e in mgr.take_events()],
        )
    )


def _store(mgr: OffloadManager, rng: random.Random, keys: list[bytes], rid: int) -> Any:
    if rng.random() < 0.1:
        keys = keys + keys[:2]  # repeated keys: the general path
    ids = np.asarray(mgr.allocate(f"s{rid}", len(keys)), dtype=np.int64)
    if rng.random() < 0.3:
        ids = ids[::-1].copy()
    parents = [None, *keys[:-1]] if rng.random() < 0.2 else None
    return mgr.store_many(ids, keys, parents=parents)


def _load(mgr: OffloadManager, rng: random.Random, keys: list[bytes], rid: int, out: list) -> Any:  # type: ignore[type-arg]
    hits = mgr.lookup(keys)
    out.append(("lookup", hits))
    if not hits:
        return None
    ids = np.asarray(mgr.allocate(f"l{rid}", hits), dtype=np.int64)
    return mgr.load_many(keys[:hits], ids[::-1].copy() if rng.random() < 0.5 else ids)


async def _program(seed: int, out: list[Any]) -> None:
    rng = random.Random(seed)
    policy = rng.choice(["lru", "lru", "arc", "s3fifo", "reuse", "online"])
    tick = itertools.count()  # a virtual clock: reuse and online read one
    options = {"clock": lambda: next(tick) * 0.01} if policy in ("reuse", "online") else {}
    config = ManagerConfig(
        num_cpu_blocks=rng.choice([6, 12, 24, 33, 64]), policy=policy, policy_options=options
    )
    universe = [hashlib.blake2b(b"%d-%d" % (seed, i), digest_size=16).digest() for i in range(600)]
    async with OffloadManager([torch.zeros(256, 2, 4)], config, engine=NullEngine()) as mgr:
        futures: list[Any] = []
        for rid in range(rng.randint(40, 80)):
            op = rng.random()
            start = rng.randrange(0, 570) if rng.random() < 0.6 else rng.randrange(0, 70)
            keys = universe[start : start + rng.randint(1, 30)]
            try:
                if op < 0.5:
                    futures.append(_store(mgr, rng, keys, rid))
                elif op < 0.75:
                    futures.append(_load(mgr, rng, keys, rid, out))
                elif op < 0.85:
                    out.append(("invalidate", mgr.invalidate(keys[:8])))
                elif op < 0.9:
                    tables = sorted(map(str, mgr.snapshot().tables))
                    if tables:
                        mgr.free(rng.choice(tables))
                elif op < 0.95:
                    mgr.touch(rng.sample(universe, 4))
                else:
                    out.append(("clear", mgr.clear()))
            except KVMgrError as exc:
                out.append(("error", type(exc).__name__, str(exc)))
            if rng.random() < 0.3:
                await mgr.step()
                check_invariants(mgr)
                for f in futures:
                    if f is not None and f.done():
                        r = f.result()
                        out.append(repr(r) if not hasattr(r, "stored") else
                                   (r.stored.tolist(), r.present.tolist(), r.cpu_block_ids.tolist()))  # fmt: skip
                futures = [f for f in futures if f is not None and not f.done()]
                _record(mgr, out)


def _collect_loop(self: Any, n: int, guarded: set[int]) -> list[int] | None:
    """``_collect``'s plain loop without a key predicate (what ``_collect_leaves`` replaces)."""
    always = self._can_evict  # the tier's own predicate: READY, no readers (what the arrays say)
    return lru_victims.VictimSearch._collect(self, n, lambda key: always(key), guarded)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(10))
async def test_fast_paths_give_the_general_paths_state(seed: int, monkeypatch: Any) -> None:
    fast: list[Any] = []
    await _program(seed, fast)
    monkeypatch.setattr(store, "add_new", lambda *args, **kwargs: None)
    monkeypatch.setattr(lru_victims.VictimSearch, "_leading_run", lambda self, n, g: (None, False))
    monkeypatch.setattr(runs, "sort_pairs", lambda: None)
    monkeypatch.setattr(lru_victims.VictimSearch, "_collect_leaves", _collect_loop)
    for module in (keys_module, block_lru, gpu_blocks, key_index, store):
        monkeypatch.setattr(module, "index_c", lambda: None)
    general: list[Any] = []
    await _program(seed, general)
    assert len(fast) == len(general) > 10
    for i, (a, b) in enumerate(zip(fast, general, strict=True)):
        assert a == b, f"record {i} differs"
