"""A batched load touches the CPU tier's LRU by the blocks it looked up (``BlockLru.touch_blocks``,
issue 27) where it touched by key: random programs of stores, landings, loads (repeated keys
included), their completions and drops leave the tier exactly as touching by key does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvmgr.config import ManagerConfig
from kvmgr.errors import KVMgrError
from kvmgr.scheduler import KVGeometry
from kvmgr.scheduler.block_lru import BlockLru
from kvmgr.scheduler.bookkeeping import Bookkeeper

CPU = 1024
FEW = 128  #: ``block_lru._FEW``: a touch of more keys takes the array path


def _books(books: Bookkeeper) -> tuple[Any, ...]:
    cpu = books.cpu
    lru = cpu.policy
    assert isinstance(lru, BlockLru)
    return (
        list(cpu.index.items()), bytes(cpu.state), cpu.readers.tolist(),
        lru._log[lru._head : lru._tail].tolist(), lru._stamp.tolist(), len(lru),
        books.gpu.busy.tolist(),
    )  # fmt: skip


def _run(seed: int, by_block: bool) -> list[Any]:
    rng, out, loads, stored = np.random.default_rng(seed), [], [], []
    books = Bookkeeper(
        ManagerConfig(num_cpu_blocks=CPU, policy="lru", manage_gpu_blocks=False),
        KVGeometry(512, (16,)),
    )
    if not by_block:  # the long way: the policy touched by key
        books.cpu.policy.touch_blocks = None
    for step in range(80):
        roll = rng.random()
        try:
            if roll < 0.35:
                keys = [b"s%d-%d" % (step, i) for i in range(int(rng.integers(100, 300)))]
                part = books.prepare_store(np.arange(len(keys)), keys, None, None, batched=True)
                books.cpu.stores_landed(np.asarray(part.cpu_ids), all_pending=True)
                books.gpu.release(np.asarray(part.gpu_ids))
                stored += keys
            elif roll < 0.75 and stored:
                n = int(rng.integers(FEW - 8, 200))  # a few at or under FEW: the key path
                indexed = list(books.cpu.index)
                keys = [indexed[int(i)] for i in rng.integers(0, len(indexed), n)]
                if rng.random() < 0.2:
                    keys[-1] = b"never stored"  # UnknownKeyError, nothing changed
                gpu = np.arange(300, 300 + n, dtype=np.int64)
                part = books.prepare_load(keys, gpu, None, batched=True)
                loads.append(part)
                out.append(("loaded", len(set(keys)) < n))  # (a key twice: its first place)
            elif roll < 0.9 and loads:
                part = loads.pop(int(rng.integers(0, len(loads))))
                books.cpu.remove_readers(np.asarray(part.cpu_ids))
                books.gpu.release(np.asarray(part.gpu_ids))
            elif stored:
                books.cpu.drop([k for k in list(books.cpu.index)[:5] if books.cpu.can_evict(k)])
            out.append(None)
        except KVMgrError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
        out.append(_books(books))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_loads_touching_by_block_leave_the_tier_as_touching_by_key(seed: int) -> None:
    got = _run(seed, by_block=True)
    assert got == _run(seed, by_block=False)
    loaded = [x[1] for x in got if type(x) is tuple and x[0] == "loaded"]
    assert len(loaded) > 15 and any(loaded)  # loads ran, some with a key twice
