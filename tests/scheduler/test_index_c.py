"""The C passes of a batched store (``kvmgr._index_c``, issue 27) give what their Python paths
give: ``bytes_list`` as ``check_keys``' Python checks (the same list, the same typed error),
``add_absent`` the same index (entries and order) and verdict, ``increasing_ok`` never
accepting ids the numpy checks refuse; and random programs of stores, landings and drops
leave the CPU tier exactly as with the module missing (CI's case: no Triton). Each test of the
module itself is skipped where it does not build."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch  # noqa: F401  (loaded: the module is built only where torch is)
from test_key_index import _books, _rig, _step

import kvmgr._keys as keys_module
import kvmgr.scheduler.gpu_blocks as gpu_module
import kvmgr.scheduler.key_index as index_module
from kvmgr._index_c import index_c
from kvmgr.errors import InvalidBlockError, InvalidKeyError
from kvmgr.scheduler.gpu_blocks import GpuBlocks

module = index_c()
needs_c = pytest.mark.skipif(module is None, reason="kvmgr's C modules do not build here")


def _no_c(monkeypatch: pytest.MonkeyPatch) -> None:
    for where in (keys_module, gpu_module, index_module):
        monkeypatch.setattr(where, "index_c", lambda: None)


def _keys(rng: np.random.Generator, n: int, pool: int) -> list[Any]:
    return [b"k%d" % k for k in rng.integers(0, pool, n)]


def _checked(keys: object) -> object:
    try:
        return keys_module.check_keys(keys)
    except InvalidKeyError as exc:
        return str(exc)


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_bytes_list_checks_keys_as_the_python_path(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(seed)
    bad = [b"", "str", bytearray(b"x"), None, 7, memoryview(b"y")]
    cases: list[Any] = []
    for _ in range(200):
        keys = _keys(rng, int(rng.integers(0, 30)), 1000)
        if keys and rng.random() < 0.5:
            keys[int(rng.integers(0, len(keys)))] = bad[int(rng.integers(0, len(bad)))]
        cases.append(tuple(keys) if rng.random() < 0.3 else keys)
    with_c = [_checked(keys) for keys in cases]
    for keys in cases[:5]:  # a new list, not the caller's
        got = keys_module.check_keys(keys) if all(type(k) is bytes and k for k in keys) else None
        assert got is None or (got is not keys and type(got) is list)
    _no_c(monkeypatch)
    assert with_c == [_checked(keys) for keys in cases]
    assert module.bytes_list([b"a"] * 9) == [b"a"] * 9
    assert module.bytes_list([b"a"] * 8 + [b""]) is None
    assert module.bytes_list(iter([b"a"])) is None  # only lists and tuples


def _index(rng: np.random.Generator) -> dict[bytes, int]:
    index = {b"k%d" % k: int(k) for k in rng.permutation(60)[:40]}
    for key in list(index)[:: int(rng.integers(2, 6))]:  # holes, and keys moved to the end
        value = index.pop(key)
        if rng.random() < 0.5:
            index[key] = value
    return index


@needs_c
@pytest.mark.parametrize("seed", range(6))
def test_add_absent_leaves_the_index_as_the_python_path(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(300):
        n = int(rng.integers(0, 40))
        keys = _keys(rng, n, 100 if rng.random() < 0.5 else 100_000)  # some present, repeated
        values: Any = rng.integers(0, 99, n).tolist() if rng.random() < 0.7 else -1
        cases.append((_index(np.random.default_rng(int(rng.integers(1 << 30)))), keys, values))

    def run() -> list[Any]:
        out = []
        for index, keys, values in cases:
            index = dict(index)
            out.append((index_module.add_absent(index, keys, values), list(index.items())))
        return out

    with_c = run()
    assert any(ok for ok, _ in with_c) and not all(ok for ok, _ in with_c)
    _no_c(monkeypatch)
    assert with_c == run()


@needs_c
def test_add_absent_in_c_stops_at_a_key_that_is_not_bytes() -> None:
    index = {b"a": 1}
    assert module.add_absent(index, [b"b", b"c", "d", b"e"], [2, 3, 4, 5]) == 2
    assert list(index.items()) == [(b"a", 1), (b"b", 2), (b"c", 3)]
    with pytest.raises(ValueError, match="one value per key"):
        module.add_absent(index, [b"x", b"y"], [1])
    with pytest.raises(TypeError):
        module.add_absent(index, (b"x",), [1])
    big = {b"%d" % i: i for i in range(200_000)}  # (the prefetch on a large table)
    keys = [b"n%d" % i for i in range(600)]
    assert module.add_absent(big, keys, list(range(600))) == 600
    assert list(big.items())[-600:] == list(zip(keys, range(600)))


@needs_c
@pytest.mark.parametrize("size", [90, 20_000, 300_000])  # int8, int16, int32 index slots
def test_add_absent_through_long_probe_chains_as_the_python_path(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefetch follows each key's probes (up to 8) through taken slots and the dummies of
    deleted keys: the index and verdicts stay the Python path's, a present key met deep in a
    chain included."""
    rng = np.random.default_rng(size)
    full = {b"%d" % i: i for i in range(size)}
    deleted = [b"%d" % i for i in rng.choice(size, size // 3, replace=False)]
    gone = set(deleted)
    present = [k for k in full if k not in gone]
    cases = []
    for _ in range(6):
        n = int(rng.integers(65, 300))  # more than one chunk of 64
        keys: list[Any] = [b"f%d-%d" % (size, int(k)) for k in rng.integers(0, 1 << 40, n)]
        if rng.random() < 0.5:  # a present key late in the call
            keys[int(rng.integers(64, n))] = present[int(rng.integers(0, len(present)))]
        cases.append((keys, list(range(n))))

    def run() -> list[Any]:
        out = []
        for keys, values in cases:
            index = dict(full)  # (a copy of a dict with deletions would drop its dummies)
            for key in deleted:
                del index[key]  # dummies in the index the keys probe through
            out.append(
                (
                    index_module.add_absent(index, keys, values),
                    list(index.items())[-400:],
                    len(index),
                )
            )
        return out

    with_c = run()
    _no_c(monkeypatch)
    assert with_c == run()


def _verdict(gpu: GpuBlocks, ids: np.ndarray) -> object:
    try:
        gpu.check_array(ids, "store")
        return None
    except InvalidBlockError as exc:
        return str(exc)


@needs_c
@pytest.mark.parametrize("owned", [True, False])
def test_increasing_ok_accepts_only_what_the_numpy_checks_accept(
    owned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(3)
    gpu = GpuBlocks(32, owned=owned)
    if owned:
        gpu.allocate(20)
    cases = []
    for _ in range(600):
        ids = np.unique(rng.integers(-1 if rng.random() < 0.1 else 0, 33, int(rng.integers(1, 24))))
        if rng.random() < 0.2:
            ids = ids[::-1]
        if rng.random() < 0.1:
            ids = np.sort(np.concatenate([ids, ids[:1]]))  # a repeat
        cases.append(ids.astype(np.int64 if rng.random() < 0.9 else np.int32))
    oks = [module.increasing_ok(ids, gpu.state if owned else None, 1, 32) for ids in cases]
    assert any(oks) and not all(oks)
    with_c = [_verdict(gpu, ids.astype(np.int64)) for ids in cases]
    _no_c(monkeypatch)
    assert with_c == [_verdict(gpu, ids.astype(np.int64)) for ids in cases]
    assert all(v is None for ok, v in zip(oks, with_c) if ok)
    assert not any(ok for ok, ids in zip(oks, cases) if ids.dtype != np.int64)
    strided = np.arange(10, dtype=np.int64)[::2]
    assert not module.increasing_ok(strided, None, 1, 32)  # not C-contiguous: numpy decides


def _program(rng: np.random.Generator) -> list[tuple[Any, ...]]:
    program: list[tuple[Any, ...]] = []
    for _ in range(60):
        roll = rng.random()
        if roll < 0.4:  # 9-16 keys from 200: some indexed already, some repeated
            program.append(("store", [b"p%d" % k for k in rng.integers(0, 200, rng.integers(9, 17))]))  # fmt: skip
        elif roll < 0.6:  # all new
            program.append(("store", [b"n%d" % k for k in rng.permutation(10_000)[:12]]))
        elif roll < 0.9:
            program.append(("land", int(rng.integers(0, 100))))
        else:
            program.append(("drop", int(rng.integers(0, 8))))
    return program


@needs_c
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", range(6))
def test_random_programs_leave_the_tier_as_without_the_module(
    policy: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    program = _program(np.random.default_rng(seed))

    def run() -> list[Any]:
        stores, pending, out = _rig(policy), [], []
        for op in program:
            out.append((_step(stores, pending, op), _books(stores)))
        return out

    with_c = run()
    _no_c(monkeypatch)
    assert with_c == run()


@needs_c
def test_set_items_updates_and_deletes_as_the_python_loops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def run() -> list[Any]:
        rng, out = np.random.default_rng(5), []
        for _ in range(100):
            index = _index(rng)
            keys = [k for k in index if rng.random() < 0.5]
            if rng.random() < 0.3:  # a missing key in the middle: KeyError, those before done
                keys.insert(len(keys) // 2, b"missing")
            values = None if rng.random() < 0.5 else rng.integers(0, 9, len(keys)).tolist()
            try:
                index_module.set_items(index, keys, values)
                out.append((list(index.items()), None))
            except KeyError as exc:
                out.append((list(index.items()), repr(exc)))
        return out

    with_c = run()
    assert any(error for _, error in with_c) and not all(error for _, error in with_c)
    _no_c(monkeypatch)
    assert with_c == run()


@pytest.mark.parametrize("path", ["c", "python"])
@pytest.mark.parametrize(
    "values",
    [(7, 8), np.array([7, 8]), [7], [7, 8, 9], np.int64(7), None],
    ids=["tuple", "array", "short", "long", "numpy-int", "none"],
)
def test_add_absent_values_not_a_list_or_int_are_refused_on_both_paths(
    path: str, values: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C loop took a tuple or an array as ONE value for every key, where the Python path
    zipped it (newuser13's leftover, leftovers14): both now refuse it, and a list of another
    length, with ``InvalidArgumentError`` before anything is indexed."""
    from kvmgr.errors import InvalidArgumentError

    if path == "python":
        _no_c(monkeypatch)
    elif module is None:
        pytest.skip("kvmgr's C modules do not build here")
    index = {b"a": 1}
    with pytest.raises(InvalidArgumentError, match="add_absent"):
        index_module.add_absent(index, [b"x", b"y"], values)
    assert index == {b"a": 1}
    assert index_module.add_absent(index, [b"x", b"y"], [7, 8]) is True
    assert index_module.add_absent(index, [b"z"], 5) is True
    assert list(index.items()) == [(b"a", 1), (b"x", 7), (b"y", 8), (b"z", 5)]
