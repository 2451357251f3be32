"""The C scatters (``kvmgr._ids_c``, issue 27) write what their numpy paths write: ``add_at`` as
``np.add.at``, ``set_at`` as a fancy assignment, nothing for buffers of other kinds or an id
out of range; and the GPU blocks' busy counts and the queue's marks end the same through random
programs of acquires, releases and queued parts with the module missing (CI's case: no Triton).
Each test of the module itself is skipped where it does not build."""

from __future__ import annotations

import array
from typing import Any

import numpy as np
import pytest
import torch  # noqa: F401  (loaded: the module is built only where torch is)

import kvmgr.scheduler.gpu_blocks as gpu_module
import kvmgr.scheduler.queue as queue_module
from kvmgr._ids_c import ids_c
from kvmgr.scheduler.gpu_blocks import GpuBlocks
from kvmgr.scheduler.lanes import Kind, Part
from kvmgr.scheduler.queue import SwapQueue

module = ids_c()
needs_c = pytest.mark.skipif(module is None, reason="kvmgr's C modules do not build here")


def _no_c(monkeypatch: pytest.MonkeyPatch) -> None:
    for where in (gpu_module, queue_module):
        monkeypatch.setattr(where, "ids_c", lambda: None)


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_scatters_write_what_numpy_writes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(200):
        size = int(rng.integers(1, 50))
        ids = rng.integers(0, size, int(rng.integers(0, 60)))  # repeats: add_at counts each
        value = int(rng.integers(-5, 5))
        q = array.array("q", rng.integers(-9, 9, size).tolist())
        ref = np.array(q, dtype=np.int64)
        assert module.add_at(q, ids, value) is True
        np.add.at(ref, ids, value)
        assert np.array(q).tolist() == ref.tolist()
        arr = rng.integers(-9, 9, size)
        ref = arr.copy()
        assert module.set_at(arr, ids, value) is True
        ref[ids] = value
        assert arr.tolist() == ref.tolist()


@needs_c
@pytest.mark.parametrize("name", ["add_at", "set_at"])
def test_scatters_write_nothing_for_other_buffers_or_ids_out_of_range(name: str) -> None:
    fn = getattr(module, name)
    target = np.arange(8, dtype=np.int64)
    ids = np.array([1, 2], dtype=np.int64)
    refused: list[Any] = [
        (target, np.array([1, 8])),  # past the end
        (target, np.array([-1, 2])),  # negative
        (target, ids.astype(np.int32)),
        (target, np.arange(6, dtype=np.int64)[::2]),  # not contiguous
        (target.astype(np.int32), ids),
        (target[::2].copy()[::-1], ids),  # a reversed view
        (np.arange(8, dtype=np.int64).reshape(2, 4), ids),
        (bytes(64), ids),  # read-only
        (target, [1, 2]),  # a list: numpy's path
    ]
    for dst, at in refused:
        before = np.array(dst, copy=True) if not isinstance(dst, bytes) else dst
        assert fn(dst, at, 3) is False
        assert np.array_equal(np.asarray(dst) if not isinstance(dst, bytes) else dst, before)
    with pytest.raises(TypeError):
        fn(target, ids)
    with pytest.raises(TypeError):
        fn(target, ids, "3")


def _busy_and_marks(seed: int) -> list[Any]:
    rng, out = np.random.default_rng(seed), []
    gpu, queue = GpuBlocks(64, owned=False), SwapQueue(64)
    held: list[np.ndarray] = []
    for _ in range(150):
        roll = rng.random()
        if roll < 0.4:
            ids = np.sort(rng.permutation(64)[: int(rng.integers(9, 40))]).astype(np.int64)
            gpu.acquire(ids)
            held.append(ids)
            kind = Kind.STORE if rng.random() < 0.6 else Kind.LOAD
            queue.add(Part(kind, None, None, ids, ids.copy(), None))
        elif roll < 0.7 and held:
            ids = held.pop(int(rng.integers(0, len(held))))
            gpu.release(np.concatenate([ids, ids[:3]]))  # repeats: one count each
        out.append((gpu.busy.tolist(), queue._read.tolist(), queue._written.tolist()))
        out.append([(g.number, len(g.d2h.parts), len(g.h2d.parts)) for g in queue.generations])
    return out


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_random_programs_leave_busy_counts_and_marks_as_without_the_module(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_c = _busy_and_marks(seed)
    _no_c(monkeypatch)
    assert with_c == _busy_and_marks(seed)


def test_ids_out_of_range_raise_numpys_error_with_or_without_the_module() -> None:
    gpu = GpuBlocks(8, owned=False)
    with pytest.raises(IndexError):
        gpu.acquire(np.array([3, 8], dtype=np.int64))
    assert gpu.busy.tolist() == [0] * 8


def _numpy_live(log: np.ndarray, stamp: np.ndarray, head: int, n: int) -> bool:
    return bool((stamp[log[head : head + n]] == np.arange(head, head + n)).all())


def _numpy_chain(run: np.ndarray, state: np.ndarray, readers: np.ndarray, up: np.ndarray, kids: np.ndarray) -> bool:  # fmt: skip
    """``_leading_run``'s common case in numpy (``ready`` 1)."""
    return bool(
        (state[run] == 1).all()
        and not readers[run].any()
        and (up[run][:-1] == run[1:]).all()
        and kids[run][0] == 0
        and (kids[run][1:] == 1).all()
    )


def run_arrays(rng: Any, size: int, n: int, *, chain: bool) -> tuple[np.ndarray, ...]:
    """A run of ``n`` blocks of ``size`` READY ones without readers, one chain (leaf first) or
    roots without children, then a few entries spoiled: (run, state, readers, up, kids)."""
    run = rng.permutation(size)[:n].astype(np.int64)
    state = np.ones(size, dtype=np.uint8)
    readers, up, kids = (np.zeros(size, dtype=np.int64) for _ in range(3))
    if chain:
        up[run[:-1]], kids[run[1:]] = run[1:], 1
    else:
        up[:] = -1
    for _ in range(int(rng.integers(0, 3))):
        where = (state, readers, up, kids)[int(rng.integers(0, 4))]
        where[run[int(rng.integers(0, n))]] = int(rng.integers(0, 3))
    return run, state, readers, up, kids


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_live_run_and_chain_ok_decide_as_numpy(seed: int) -> None:
    rng, verdicts = np.random.default_rng(seed), set()
    for _ in range(400):
        size, n = 40, int(rng.integers(1, 12))
        run, state, readers, up, kids = run_arrays(rng, size, n, chain=True)
        got = module.chain_ok(run, bytearray(state), 1, array.array("q", readers), array.array("q", up), array.array("q", kids))  # fmt: skip
        assert got is _numpy_chain(run, state, readers, up, kids)
        verdicts.add(got)
        log = rng.integers(0, size, 30)
        stamp = rng.integers(0, 30, size)
        head = int(rng.integers(0, 30 - n))
        if rng.random() < 0.6:  # live entries, but for a few
            stamp[log[head : head + n]] = np.arange(head, head + n)
        live = module.live_run(array.array("q", log), array.array("q", stamp), head, n)
        assert live is _numpy_live(log, stamp, head, n)
        verdicts.add(("live", live))
    assert verdicts == {True, False, ("live", True), ("live", False)}
    log, stamp = array.array("q", [0, 1, 5]), array.array("q", [0, 1])  # 5: outside stamp
    assert module.live_run(log, stamp, 0, 3) is None and module.live_run(log, stamp, 2, 2) is None
    assert module.live_run(np.zeros(3, dtype=np.int32), stamp, 0, 1) is None
    q = array.array("q", [0, 0])
    assert module.chain_ok(np.array([0, 5]), bytearray(2), 0, q, q, q) is False  # outside


def _tier_program(seed: int) -> list[Any]:
    """Random stores into a small tier (every few evict through ``_leading_run``), landings
    and drops: what each returned and the tier's books after each."""
    from test_index_c import _program
    from test_key_index import _books, _rig, _step

    stores, pending = _rig("lru"), []
    return [(_step(stores, pending, op), _books(stores)) for op in _program(np.random.default_rng(seed))]  # fmt: skip


@needs_c
@pytest.mark.parametrize("seed", range(6))
def test_random_evicting_programs_leave_the_tier_as_without_the_module(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvmgr.scheduler.block_lru as lru_module
    import kvmgr.scheduler.lru_victims as victims_module

    with_c = _tier_program(seed)
    for where in (lru_module, victims_module):
        monkeypatch.setattr(where, "ids_c", lambda: None)
    _no_c(monkeypatch)
    assert with_c == _tier_program(seed)
