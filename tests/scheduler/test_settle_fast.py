"""The settle's fast path (``fresh_store.add_new`` with an ``order``, percall3) against its
general path (``settle.FAST = False``: a disjointness check, ``make_room``, ``add_pending``),
and the LRU's leaves-only leading run (``kvmgr._ids_c.leaves_ok``, its victims' chains removed by
``KeyChains.remove_isolated`` when they are roots too) against numpy's and ``remove``: random
programs of per-call stores (one block and a few, GPU blocks stored twice, some with parents
not indexed, keys promoted
between the call and its settle), lookups, loads, invalidations and steps run through both,
with every piece of state compared after each step: the index in order, the CPU states, the
allocator, the chains, the LRU order, GPU busy counts, the results, errors and KV events."""

from __future__ import annotations

import array
import hashlib
import random
from typing import Any

import numpy as np
import pytest
import torch

import kvmgr.scheduler.gpu_blocks as gpu_blocks
import kvmgr.scheduler.lru_victims as lru_victims
import kvmgr.scheduler.settle as settle_module
from kvmgr import ManagerConfig, OffloadManager
from kvmgr._ids_c import ids_c
from kvmgr.errors import KVMgrError
from kvmgr.testing import NullEngine, check_invariants

module = ids_c()


def _state(mgr: OffloadManager) -> Any:
    mgr._settle_deferred()
    books = mgr._books
    cpu, gpu = books.cpu, books.gpu
    pool = cpu.pool
    policy = cpu.policy
    order = policy.ordered_keys() if hasattr(policy, "ordered_keys") else sorted(mgr.snapshot().policy_keys)  # fmt: skip
    return (
        list(cpu.index.items()),
        bytes(cpu.state),
        (pool.num_free, pool._next_fresh, pool._top, pool._stack_np[: pool._top].tolist()),
        sorted(mgr.snapshot().key_parents.items()),
        (
            sorted(cpu.chains.loose.items()),
            sorted(cpu.chains.orphans.items()),
            cpu.chains.num_parents,
        ),
        (cpu.chains._up_np.tolist(), cpu.chains._kids_np.tolist()),
        order,
        gpu.busy.tolist(),
        (cpu.num_pending, cpu.num_loading, cpu.reserved),
        [repr(e) for e in mgr.take_events()],
    )


def _result(f: Any) -> Any:
    try:
        return repr(f.result())
    except BaseException as exc:  # compared, not hidden
        return ("failed", type(exc).__name__, str(exc))


async def _program(seed: int) -> list[Any]:
    rng = random.Random(seed)
    policy = rng.choice(["lru", "lru", "arc", "s3fifo"])
    num_cpu = rng.choice([5, 9, 16, 24, 40, 400])
    config = ManagerConfig(num_cpu_blocks=num_cpu, policy=policy)
    universe = [hashlib.blake2b(b"%d-%d" % (seed, i), digest_size=16).digest() for i in range(300)]
    out: list[Any] = []
    async with OffloadManager([torch.zeros(128, 2, 4)], config, engine=NullEngine()) as mgr:
        held = mgr.allocate("r", 64)
        futures: list[Any] = []
        for _ in range(rng.randint(30, 70)):
            op = rng.random()
            try:
                if op < 0.1:  # a burst of one-block stores: a settle evicting more than 8
                    for _ in range(rng.randint(9, 30)):
                        key = universe[rng.randrange(0, 300)]
                        futures.append(mgr.swap_out([rng.choice(held)], [key]))
                elif op < 0.7:  # a plain per-call store: recorded (one block, or a few)
                    n = 1 if rng.random() < 0.8 else rng.randint(2, 4)
                    start = rng.randrange(0, 290)
                    ids = rng.sample(held[:16] if rng.random() < 0.3 else held, n)  # repeats
                    keys = universe[start : start + n]
                    if rng.random() < 0.15:  # prepared now; a parent maybe not indexed: loose
                        extra = {"parents": [rng.choice(universe), *keys[:-1]]}
                        futures.append(mgr.swap_out(ids, keys, **extra))
                    else:
                        futures.append(mgr.swap_out(ids, keys))
                elif op < 0.78:
                    keys = universe[rng.randrange(0, 290) :][:3]
                    hits = mgr.lookup(keys)
                    out.append(("lookup", hits))
                    if hits:
                        futures.append(mgr.swap_in(keys[:hits], held[40 : 40 + hits]))
                elif op < 0.84:
                    out.append(("invalidate", mgr.invalidate(rng.sample(universe, 6))))
                elif op < 0.88:  # a promote between the calls and their settle
                    recorded = list(mgr._deferred._seen)
                    key = rng.choice(recorded if recorded and rng.random() < 0.7 else universe)
                    books = mgr._books
                    if key not in books.cpu.index and books.cpu.pool.num_free > books.cpu.reserved:
                        got = books.prepare_promote([key], ())
                        books.complete_promote([key], got, np.ones(1, dtype=bool))
                else:
                    await mgr.step()
                    out.append([_result(f) for f in futures])
                    futures = []
                    check_invariants(mgr)
                    out.append(_state(mgr))
            except KVMgrError as exc:
                out.append(("error", type(exc).__name__, str(exc)))
        await mgr.step()
        out.append([_result(f) for f in futures])
        out.append(_state(mgr))
    return out


def _general(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settle_module, "FAST", False)
    for where in (gpu_blocks, lru_victims):
        monkeypatch.setattr(where, "ids_c", lambda: None)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(32))
async def test_the_settle_leaves_the_general_paths_state(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = await _program(seed)
    _general(monkeypatch)
    general = await _program(seed)
    assert len(fast) == len(general) > 5
    for i, (a, b) in enumerate(zip(fast, general, strict=True)):
        assert a == b, f"record {i} differs"


@pytest.mark.asyncio
async def test_the_programs_take_each_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The programs above reach both of ``add_new``'s branches, the one-by-one fallback
    (a key promoted since its call) and the leaves-only run: the comparison covers them."""
    from kvmgr.scheduler import fresh_store

    seen: set[str] = set()
    real_add, real_drop = fresh_store.add_new, fresh_store.drop_last

    def add_new(cpu: Any, keys: Any, parents: Any, order: Any = None) -> Any:
        room = len(keys) + cpu.reserved <= cpu.pool.num_free
        got = real_add(cpu, keys, parents, order)
        seen.add(("room" if room else "evict") + ("" if got is not None else " refused"))
        return got

    monkeypatch.setattr(settle_module, "add_new", add_new)
    real_leaves = module.leaves_ok if module is not None else None

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(module, name)

        def leaves_ok(self, *args: Any) -> int:
            kind = real_leaves(*args)  # type: ignore[misc]
            seen.add(f"leaves {kind}")
            return kind  # type: ignore[no-any-return]

    if module is not None:
        monkeypatch.setattr(lru_victims, "ids_c", lambda: Spy())
    assert real_drop is fresh_store.drop_last
    for seed in range(32):
        await _program(seed)
    assert {"room", "evict", "room refused"} <= seen
    if module is not None:
        assert {"leaves 0", "leaves 1", "leaves 2"} <= seen


def _numpy_leaves(run: np.ndarray, state: np.ndarray, readers: np.ndarray, up: np.ndarray, kids: np.ndarray) -> int:  # fmt: skip
    if not ((state[run] == 1).all() and not readers[run].any() and not kids[run].any()):
        return 0
    return 2 if (up[run] < 0).all() else 1


@pytest.mark.skipif(module is None, reason="kvmgr's C modules do not build here")
@pytest.mark.parametrize("seed", range(4))
def test_leaves_ok_decides_as_numpy(seed: int) -> None:
    from test_ids_c import run_arrays

    rng, verdicts = np.random.default_rng(seed), set()
    for _ in range(400):
        run, state, readers, up, kids = run_arrays(rng, 40, int(rng.integers(1, 12)), chain=False)
        q = [array.array("q", a.tolist()) for a in (readers, up, kids)]
        got = module.leaves_ok(run, bytearray(state), 1, *q)
        assert got == _numpy_leaves(run, state, readers, up, kids) and type(got) is int
        verdicts.add(got)
    assert verdicts == {0, 1, 2}
    q0 = array.array("q", [0, 0])
    assert module.leaves_ok(np.array([0, 5]), bytearray(2), 0, q0, q0, q0) == 0  # outside
    assert module.leaves_ok(np.array([0], dtype=np.int32), bytearray(2), 0, q0, q0, q0) == 0
