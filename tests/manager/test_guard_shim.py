"""The moved-tensor check's shim path (``kvmgr.worker._guard_c``): on random tensors and random
programs of moves, restores and writes, its verdict is exactly the four-list compare's, and
``TensorGuard.moved`` says what the compare says; the handles it holds are freed with it."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvmgr.worker import _guard_c
from kvmgr.worker.tensors import TensorGuard

pytestmark = pytest.mark.skipif(
    _guard_c._module() is None, reason="the shim's C check does not build here"
)

DTYPES = [torch.uint8, torch.bfloat16, torch.float32, torch.int64]


def _meta(t: torch.Tensor) -> tuple[object, ...]:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _tensors(rng: np.random.Generator) -> list[torch.Tensor]:
    out = []
    for _ in range(int(rng.integers(1, 9))):
        shape = tuple(int(x) for x in rng.integers(1, 6, size=int(rng.integers(1, 5))))
        t = torch.zeros(shape, dtype=DTYPES[int(rng.integers(len(DTYPES)))])
        if t.dim() >= 2 and rng.random() < 0.3:
            t = t.transpose(0, 1)  # strided
        out.append(t)
    return out


def _retype(t: torch.Tensor) -> None:
    other = torch.int16 if t.dtype.itemsize == 2 else torch.uint8 if t.dtype.itemsize == 1 else torch.int32  # fmt: skip
    if t.dtype.itemsize == 8:
        other = torch.float64
    t.data = torch.tensor([], dtype=other).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())  # fmt: skip


def _ops(alias: torch.Tensor) -> list[Callable[[torch.Tensor], object]]:
    """Moves, restores and writes one tensor may get (``alias``: its first metadata)."""
    return [
        lambda t: t.resize_(*(s + 1 for s in t.shape)),  # grow: maybe a new pointer
        lambda t: t.resize_(*t.shape[:-1], max(1, t.shape[-1] - 1)),  # shrink: same pointer
        lambda t: t.set_(torch.zeros_like(t)),  # new storage, same shape
        lambda t: t.as_strided_(t.shape, tuple(reversed(t.stride()))),
        lambda t: t.unsqueeze_(0),
        lambda t: t.squeeze_(0) if t.shape[0] == 1 else t.unsqueeze_(-1),
        lambda t: t.transpose_(0, -1),
        _retype,
        lambda t: setattr(t, "data", alias),  # back to the first metadata (maybe its pointer)
        lambda t: setattr(t, "data", alias),
        lambda t: t.fill_(1),  # a write: nothing moves
        lambda t: t.add_(1),
    ]


@pytest.mark.parametrize("seed", range(60))
def test_the_shim_check_agrees_with_the_compare_on_random_programs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    kv = _tensors(rng)
    before = [_meta(t) for t in kv]
    aliases = [t.detach() for t in kv]  # new impls over the same storage and metadata
    guard = TensorGuard(kv)
    same = guard._same
    assert same is not None and same() is True and guard.moved() is None
    for _ in range(12):
        i = int(rng.integers(len(kv)))
        ops = _ops(aliases[i])
        with contextlib.suppress(RuntimeError):  # one torch refuses (out of bounds)
            ops[int(rng.integers(len(ops)))](kv[i])
        unmoved = [_meta(t) for t in kv] == before
        assert same() is unmoved
        reason = guard.moved()
        assert (reason is None) is unmoved
        assert reason == guard._compare()


def test_unmoved_tensors_never_reach_the_compare(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = [torch.zeros(4, 8), torch.zeros(4, 2, 4, dtype=torch.bfloat16)]
    guard = TensorGuard(kv)
    compared: list[object] = []
    monkeypatch.setattr(guard, "_compare", lambda: compared.append(1))
    monkeypatch.setattr(guard, "_read", lambda *a: compared.append(2))  # torch's check neither
    for _ in range(3):
        assert guard.moved() is None
    assert compared == []


def test_a_refusing_shim_check_is_rebuilt_once_and_the_compare_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = [torch.zeros(4, 8), torch.zeros(4, 8)]
    guard = TensorGuard(kv)
    built: list[object] = []
    real = _guard_c.same_check

    def refusing(tensors: list[torch.Tensor]) -> Callable[[], bool]:
        built.append(real(tensors))
        return lambda: False

    monkeypatch.setattr("kvmgr.worker.tensors.same_check", refusing)
    guard._same = lambda: False  # e.g. a state the compare does not look at
    guard._check = None  # (torch's check, where it accepts, would decide before the compare)
    for _ in range(4):
        assert guard.moved() is None
    assert len(built) == 1  # one rebuild, then the compare each time
    kv[1].set_(torch.zeros(4, 8))
    assert guard.moved().startswith("KV tensor 1 moved")


def test_the_handles_are_freed_with_the_check() -> None:
    t = torch.zeros(3, 4)
    assert t._use_count() == 1
    guard = TensorGuard([t])
    assert guard._same is not None and t._use_count() == 2  # the handle's reference
    del guard
    gc.collect()
    assert t._use_count() == 1


def test_what_the_shim_cannot_read_gets_no_check() -> None:
    assert _guard_c.same_check([torch.zeros(3, 3).to_sparse()]) is None
    assert _guard_c.same_check([]) is None
    assert _guard_c.same_check([torch.zeros(2), "not a tensor"]) is None  # type: ignore[list-item]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_guard_c, "_agrees", lambda record, tensor: False)  # the shim reads otherwise
        assert _guard_c.same_check([torch.zeros(2)]) is None


def test_swap_tensors_on_a_guarded_tensor_is_refused_or_reported() -> None:
    kv = [torch.zeros(4, 8), torch.ones(4, 8)]
    guard = TensorGuard(kv)
    other = torch.full((2, 2), 3.0)
    try:
        torch.utils.swap_tensors(kv[0], other)
    except RuntimeError:  # torch sees the check's second reference to the TensorImpl
        assert guard.moved() is None and kv[0].shape == (4, 8)
    else:
        assert guard.moved().startswith("KV tensor 0 moved")


@pytest.mark.parametrize("shape", [(2, 2), (4, 8)])
def test_a_swapped_tensor_impl_is_seen(shape: tuple[int, int]) -> None:
    """``torch._C._swap_tensor_impl`` gives the Python object another ``TensorImpl`` and leaves
    the one the handle holds as it was: the check compares the object's impl pointer too."""
    kv = [torch.zeros(4, 8), torch.ones(4, 8)]
    guard = TensorGuard(kv)
    assert guard._same() is True
    torch._C._swap_tensor_impl(kv[1], torch.full(shape, 3.0))
    assert guard._same() is False
    assert guard.moved().startswith("KV tensor 1 moved")  # another pointer, maybe a shape


def test_the_shim_check_needs_the_impl_word(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.zeros(3)
    offset = _guard_c._impl_offset([t, torch.nn.Parameter(torch.ones(2))])
    assert offset is not None and offset >= 16  # found (16 on torch 2.11 and 2.13)
    monkeypatch.setattr(_guard_c, "_impl_offset", lambda tensors: None)
    assert _guard_c.same_check([t]) is None


def test_the_snapshot_ends_with_each_tensors_storage() -> None:
    """``same``'s prefetch pass walks the records, then reads one ``StorageImpl`` address per
    tensor: they are the spec's last words (it never reads past the spec), in tensor order."""
    kv = [torch.zeros(4, 8), torch.ones(2, 3, 5).transpose(0, 2), torch.zeros(7)[2:]]
    check = _guard_c.same_check(kv)
    assert check is not None and check() is True
    spec = check.snapshot.spec  # type: ignore[attr-defined]
    records = 2 + sum(3 + 5 + 2 * t.dim() for t in kv)
    assert len(spec) == records + len(kv)
    assert spec[records:].tolist() == [t.untyped_storage()._cdata for t in kv]
