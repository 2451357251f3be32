"""``find_runs``' C call (``kvmgr.transfer._plan_c``) against the numpy path: the same runs, the
same order (stable), the same errors, for random ids with repeats, gaps, runs and bad values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmgr import _native
from kvmgr.transfer import _pairs, _plan_c, _runs
from kvmgr.transfer._runs import Runs, find_runs, find_runs_numpy

needs_c = pytest.mark.skipif(_plan_c.sort_pairs() is None, reason="kvmgr's C modules do not build")


def _outcome(fn, s, d, num_src, num_dst, merge):  # type: ignore[no-untyped-def]
    try:
        runs = fn(s, d, num_src, num_dst, merge)
    except Exception as exc:  # the error's type and words
        return type(exc), str(exc)
    assert isinstance(runs, Runs)
    arrays = (runs.src_ids, runs.dst_ids, runs.run_src, runs.run_dst)
    assert all(a.dtype == np.int64 and a.ndim == 1 for a in arrays)
    lengths = None if runs.lengths is None else runs.lengths.tolist()
    return tuple(a.tolist() for a in arrays), lengths, runs.max_run


def _same(s: list[int], d: list[int], num_src: int, num_dst: int, merge: bool) -> None:
    a, b = np.array(s, dtype=np.int64), np.array(d, dtype=np.int64)
    fast = _outcome(find_runs, a, b, num_src, num_dst, merge)
    assert fast == _outcome(find_runs_numpy, a, b, num_src, num_dst, merge)
    assert a.tolist() == s and b.tolist() == d  # the inputs are never written


_IDS = st.integers(-2, 40)


@needs_c
@settings(max_examples=400, deadline=None)
@given(
    pairs=st.lists(st.tuples(_IDS, _IDS), min_size=1, max_size=24),
    num_src=st.integers(0, 42),
    num_dst=st.integers(0, 42),
    merge=st.booleans(),
)
def test_random_pairs_give_what_the_numpy_path_gives(pairs, num_src, num_dst, merge) -> None:  # type: ignore[no-untyped-def]
    _same([p[0] for p in pairs], [p[1] for p in pairs], num_src, num_dst, merge)


@needs_c
@settings(max_examples=200, deadline=None)
@given(
    starts=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 5)), min_size=1, max_size=8),
    shift=st.integers(-1, 3),
    seed=st.integers(0, 2**16),
)
def test_shuffled_runs_with_shared_sources_match(starts, shift, seed) -> None:  # type: ignore[no-untyped-def]
    # runs of consecutive sources (some repeated: the sort must be stable) to consecutive
    # destinations, shuffled; destinations from a permutation, so they never repeat
    s = [a + k for a, length in starts for k in range(length)]
    rng = np.random.default_rng(seed)
    d = (np.arange(len(s)) + max(shift, 0)).tolist()
    if shift < 0:
        d = rng.permutation(d).tolist()
    order = rng.permutation(len(s))
    _same([s[i] for i in order], [d[i] for i in order], 40, len(s) + 4, True)


@needs_c
@pytest.mark.parametrize("bits", [7, 9, 17, 33, 62])
def test_large_ids_sort_over_every_byte(bits: int) -> None:
    # ids of several bytes (the sort runs one pass per byte of num_src - 1), some repeated,
    # with runs that survive the sort
    rng = np.random.default_rng(bits)
    num = 1 << bits
    values = rng.integers(0, num - 4, size=300, dtype=np.int64)
    s = np.concatenate((values, values[:50], values[:20] + 1, [num - 1, 0]))
    d = rng.permutation(len(s) + 5)[: len(s)]
    _same(s.tolist(), d.tolist(), num, len(s) + 5, True)
    runs = np.arange(40, dtype=np.int64)  # two runs of 20, shuffled: merged after the sort
    order = rng.permutation(40)
    _same(((runs % 20) * (num // 64) + runs // 20)[order].tolist(), runs[order].tolist(), num, 40, True)  # fmt: skip


@needs_c
@pytest.mark.parametrize(
    ("s", "d", "code"),
    [
        ([3, 4, 5], [7, 8, 9], 0),  # both consecutive: one run
        ([6, 2, 4], [0, 1, 2], 1),  # sorted, no run
        ([5, 2, 3], [9, 0, 1], 2),  # 2, 3 -> 0, 1 is a run
        ([2, 2, 1], [0, 1, 2], 1),  # a source twice: stable, 1 then 2 (to 0), 2 (to 1)
        ([1, 2, 20], [0, 1, 2], -1),  # a source out of range
        ([1, 3], [4, 4], -1),  # a destination twice
        ([1, 3, 5], [2, 2, 3], -1),  # ... in non-decreasing order
        ([8, 9, 10], [0, 1, 2], -1),  # consecutive sources past the end
        ([1, 2, 3], [8, 9, 10], -1),  # consecutive destinations past the end
        ([-1, 0, 1], [0, 1, 2], -1),  # ... before the start
    ],
)
def test_the_c_codes(s: list[int], d: list[int], code: int) -> None:
    n = len(s)
    s_out, d_out = np.full(n, -7, dtype=np.int64), np.full(n, -7, dtype=np.int64)
    args = (np.array(s, dtype=np.int64), np.array(d, dtype=np.int64), 10, 10, s_out, d_out)
    assert _plan_c.sort_pairs()(*args[:4], None, None) == (3 if code else 0)  # no outputs yet
    assert _plan_c.sort_pairs()(*args) == code
    if code in (1, 2):
        order = np.argsort(s, kind="stable")
        assert s_out.tolist() == np.take(s, order).tolist()
        assert d_out.tolist() == np.take(d, order).tolist()
    else:
        assert s_out.tolist() == d_out.tolist() == [-7] * n  # nothing written
    _same(s, d, 10, 10, True)


@needs_c
def test_buffers_of_another_kind_are_left_to_numpy() -> None:
    sort = _plan_c.sort_pairs()
    ids = np.arange(8, dtype=np.int64)
    out = np.empty(4, dtype=np.int64)
    for s, d, s_out in [
        (ids[::2], ids[:4], out),  # strided
        (ids[:4].astype(np.int32), ids[:4], out),  # another dtype
        (ids[:4], ids[:3], out),  # another length
        (ids[3::-1].copy(), ids[:4], np.empty(8, dtype=np.int64)[::2]),  # a strided output
        (ids[:1], ids[:1], out[:1]),  # one pair
    ]:
        assert sort(s, d, 10, 10, s_out, out.copy()) == -1
    _same([6, 4, 2, 0], [0, 1, 2, 3], 8, 8, True)
    strided = np.arange(16, dtype=np.int64)[::2]  # int_ids keeps it: the numpy path decides
    assert find_runs(strided, ids, 16, 8, True).src_ids.tolist() == strided.tolist()


def test_without_the_c_module_the_numpy_path_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runs, "sort_pairs", lambda: None)
    calls: list[int] = []
    numpy_path = _runs.find_runs_numpy
    monkeypatch.setattr(_runs, "find_runs_numpy", lambda *a: calls.append(1) or numpy_path(*a))
    runs = find_runs(np.array([5, 2, 3]), np.array([9, 0, 1]), 10, 10, True)
    assert runs.run_src.tolist() == [2, 5] and runs.lengths.tolist() == [2, 1]
    assert calls == [1]


def test_the_switch_turns_the_c_module_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMGR_NATIVE_LAUNCH", "0")
    assert _native.build(_plan_c._SOURCE, "kvmgr_plan") is None


@needs_c
def test_valid_merged_pairs_take_the_c_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runs, "find_runs_numpy", lambda *a: pytest.fail("numpy path taken"))
    for s, d in [([0, 1, 2], [4, 5, 6]), ([6, 2, 4], [0, 1, 2]), ([5, 2, 3], [9, 0, 1])]:
        find_runs(np.array(s, dtype=np.int64), np.array(d, dtype=np.int64), 10, 10, True)


@needs_c
def test_one_runs_descriptors_match_numpys_dot_even_where_they_wrap() -> None:
    fill = _plan_c.fill_run()
    rng = np.random.default_rng(5)
    for rows, scale in [(3, 1 << 12), (144, 1 << 40), (30, 1 << 62)]:
        matrix = rng.integers(-scale, scale, size=(rows, 4), dtype=np.int64)
        for s, d, length in [(0, 0, 1), (7, 3, 512), (1 << 40, 1 << 41, 1 << 20)]:
            out = np.full(rows, -1, dtype=np.int64)
            assert fill(matrix, out, s, d, length) is True
            expect = np.dot(matrix, np.array((s, d, length, 1), dtype=np.int64))  # wraps too
            assert out.tolist() == expect.tolist()
    matrix = np.ones((6, 4), dtype=np.int64)
    for bad_matrix, bad_out in [
        (matrix, np.empty(5, dtype=np.int64)),  # another size
        (matrix, np.empty(12, dtype=np.int64)[::2]),  # strided
        (matrix.astype(np.int32), np.empty(6, dtype=np.int64)),  # another dtype
        (matrix[:, :3].copy(), np.empty(6, dtype=np.int64)),  # rows of 3
        (np.ones((8, 3), dtype=np.int64), np.empty(6, dtype=np.int64)),  # ... as many bytes
        (np.ones(24, dtype=np.int64), np.empty(6, dtype=np.int64)),  # flat
    ]:
        before = bad_out.copy()
        assert fill(bad_matrix, bad_out, 1, 2, 3) is False
        assert bad_out.tobytes() == before.tobytes()  # nothing written


@pytest.mark.parametrize("c", ["C", "numpy"])
def test_fill_one_is_the_same_either_way(c: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if c == "C" and _plan_c.fill_run() is None:
        pytest.skip("kvmgr's C modules do not build")
    if c == "numpy":
        monkeypatch.setattr(_pairs, "fill_run", lambda: None)
    else:  # the C call writes it: numpy's dot is never reached
        monkeypatch.setattr(_pairs.np, "dot", lambda *a, **k: pytest.fail("np.dot called"))
    rng = np.random.default_rng(1)
    src, dst = _layout(rng, 5, 40), _layout(rng, 5, 90)
    tensors = _pairs.LayoutPair(src, dst)._dense
    out = np.full((3, tensors.count), -1, dtype=np.int64)
    tensors.fill_one(out, 6, 11, 9)
    s = src.base_addrs + 6 * src.block_strides
    d = dst.base_addrs + 11 * dst.block_strides
    assert out.tolist() == [s.tolist(), d.tolist(), (9 * src.page_bytes).tolist()]


def _layout(rng: np.random.Generator, tensors: int, blocks: int):  # type: ignore[no-untyped-def]
    import torch

    from kvmgr.pool.layout import KVLayout

    pages = np.full(tensors, 256, dtype=np.int64)
    return KVLayout(
        base_addrs=rng.integers(1 << 20, 1 << 40, size=tensors, dtype=np.int64),
        block_strides=pages.copy(),
        page_bytes=pages,
        num_blocks=blocks,
        device=torch.device("cpu"),
    )


def test_a_worker_builds_the_plans_c_module_before_its_first_step() -> None:
    # the module is built (or loaded from Triton's cache) at the worker's construction, so a
    # first step never pays a compile
    import torch

    from kvmgr.transfer.host import HostEngine
    from kvmgr.worker.worker import TransferWorker

    _plan_c._module.cache_clear()
    try:
        kv = [torch.zeros(4, 64, dtype=torch.uint8) for _ in range(2)]
        worker = TransferWorker(kv, 4, HostEngine())
        assert _plan_c._module.cache_info().currsize == 1
        worker.close()
    finally:
        _plan_c._module.cache_clear()
