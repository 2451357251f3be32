"""The worker's moved-tensor check (``kvmgr.worker.tensors.TensorGuard``): the shim's C check
(``kvmgr.worker._guard_c``) first, then torch's C++ tensor check plus the pointers, the exact
four-list compare wherever those refuse or are missing. Every way a KV tensor can move is reported, in every grad mode, with the
same message either way; unmoved tensors are never reported."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from kvmgr import _native, _tensor_guard
from kvmgr.worker import _guard_c
from kvmgr.worker.tensors import TensorGuard

BLOCKS, PAGE = 6, 64

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


def _kv(device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    shapes = [(BLOCKS, PAGE), (BLOCKS, 2, PAGE // 2), (BLOCKS, PAGE)]
    return [torch.randn(s, generator=generator).to(torch.bfloat16).to(device) for s in shapes]


def _resize_grow(kv: list[torch.Tensor]) -> None:
    kv[0].resize_(4 * BLOCKS, PAGE)  # new storage, a new pointer


def _resize_shrink(kv: list[torch.Tensor]) -> None:
    kv[2].resize_(BLOCKS // 2, PAGE)  # same pointer, fewer blocks


def _reshape_in_place(kv: list[torch.Tensor]) -> None:
    kv[1].resize_(2 * BLOCKS, PAGE // 2)  # same pointer and bytes, another shape


def _set_storage(kv: list[torch.Tensor]) -> None:
    kv[1].set_(torch.zeros_like(kv[1]))  # same shape and strides, new memory


def _restride(kv: list[torch.Tensor]) -> None:
    kv[1].as_strided_((BLOCKS, 2, PAGE // 2), (PAGE, 1, 2))  # same pointer and shape


def _data_view(kv: list[torch.Tensor]) -> None:
    kv[0].data = kv[0].data[1:]  # the same storage from block 1: a pointer one page on


def _retype(kv: list[torch.Tensor]) -> None:
    t = kv[2]  # same pointer, shape and strides over the same storage, another dtype
    t.data = torch.tensor([], dtype=torch.float16, device=t.device).set_(
        t.untyped_storage(), 0, t.shape, t.stride()
    )


MOVES = {
    "resize-grow": (_resize_grow, 0), "resize-shrink": (_resize_shrink, 2),
    "reshape-in-place": (_reshape_in_place, 1), "set_": (_set_storage, 1),
    "as_strided_": (_restride, 1), ".data = a view": (_data_view, 0), "dtype": (_retype, 2),
}  # fmt: skip


def _no_shim(monkeypatch: pytest.MonkeyPatch) -> None:
    """No shim check (kvmgr's C modules or torch's shim missing): torch's check comes first."""
    monkeypatch.setattr("kvmgr.worker.tensors.same_check", lambda tensors: None)


@contextlib.contextmanager
def _mode(name: str) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if name == "no_grad":
            stack.enter_context(torch.no_grad())
        elif name == "inference_mode":
            stack.enter_context(torch.inference_mode())
        yield


MODES = ["grad", "no_grad", "inference_mode"]


def _reference(kv: list[torch.Tensor], before: list[tuple[object, ...]]) -> int | None:
    """The first tensor whose (pointer, shape, strides, dtype) differs from ``before``."""
    now = [(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in kv]
    return next((i for i, (a, b) in enumerate(zip(now, before)) if a != b), None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("check_mode", MODES)
@pytest.mark.parametrize("build_mode", MODES)
@pytest.mark.parametrize("move", list(MOVES))
@pytest.mark.parametrize("guard", ["shim", "torch", "torch, pointers in Python", "compare only"])
def test_every_move_is_reported_in_every_grad_mode(
    guard: str, move: str, build_mode: str, check_mode: str, device: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    if guard == "shim" and _guard_c._module() is None:
        pytest.skip("the shim's C check does not build here")
    if guard != "shim":
        _no_shim(monkeypatch)
    if guard == "compare only":  # a torch without the C++ check
        monkeypatch.setattr(_tensor_guard, "_TensorGuards", None)
    kv = _kv(device)
    before = [(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in kv]
    with _mode(build_mode):
        tensor_guard = TensorGuard(kv)
    if guard == "torch, pointers in Python":  # kvmgr's C module did not build
        tensor_guard._read = _native._python_checked_ptrs
    assert (tensor_guard._check is None) is (guard == "compare only")
    assert (tensor_guard._same is None) is (guard != "shim")
    with _mode(check_mode):  # unmoved: never reported, twice (the second after any rebuild)
        assert tensor_guard.moved() is None
        assert tensor_guard.moved() is None
    change, index = MOVES[move]
    change(kv)
    assert _reference(kv, before) == index  # the move is one the four reads see
    with _mode(check_mode):
        for _ in range(2):  # reported, and still reported on the next flush
            reason = tensor_guard.moved()
            assert reason is not None
            assert reason.startswith(f"KV tensor {index} moved or changed shape")
            assert "resize_()/set_()/as_strided_()/.data=" in reason
            assert reason == tensor_guard._compare()  # the compare words it


@pytest.mark.parametrize("device", DEVICES)
def test_a_check_refused_in_another_mode_is_rebuilt_once_per_change(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_shim(monkeypatch)
    kv = _kv(device)
    tensor_guard = TensorGuard(kv)
    first = tensor_guard._check
    assert first is not None and first.check(*kv)
    with torch.inference_mode():
        if first.check(*kv):  # pragma: no cover - a torch whose keys ignore the mode
            pytest.skip("this torch's tensor check accepts the tensors in inference mode")
        assert tensor_guard.moved() is None  # refused, compared, rebuilt in this mode
        rebuilt = tensor_guard._check
        assert rebuilt is not first and rebuilt.check(*kv)
        assert tensor_guard.moved() is None and tensor_guard._check is rebuilt
    assert tensor_guard.moved() is None  # back in grad mode: rebuilt again
    assert tensor_guard._check is not rebuilt and tensor_guard._check.check(*kv)


class _Refusing:
    """A tensor check that refuses everything (counts its calls)."""

    def __init__(self) -> None:
        self.calls = 0

    def check(self, *tensors: torch.Tensor) -> bool:
        self.calls += 1
        return False


def test_a_check_that_always_refuses_costs_one_rebuild_and_the_compare_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[_Refusing] = []

    def refusing(tensors: object) -> _Refusing:
        built.append(_Refusing())
        return built[-1]

    monkeypatch.setattr("kvmgr.worker.tensors.tensor_guard", refusing)
    _no_shim(monkeypatch)
    kv = _kv("cpu")
    tensor_guard = TensorGuard(kv)
    for _ in range(4):
        assert tensor_guard.moved() is None
    assert len(built) == 2 and [g.calls for g in built] == [1, 3]  # one rebuild in all
    _set_storage(kv)
    assert tensor_guard.moved().startswith("KV tensor 1 moved")


def test_a_check_that_raises_falls_back_to_the_compare(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_shim(monkeypatch)
    kv = _kv("cpu")
    tensor_guard = TensorGuard(kv)
    kv.append(torch.zeros(BLOCKS, PAGE))  # another number of tensors: the check raises
    with pytest.raises(TypeError):
        tensor_guard._check.check(*kv)
    assert tensor_guard.moved() is None  # the compare zips the remembered ones
    _retype(kv)
    assert tensor_guard.moved().startswith("KV tensor 2 moved")


@pytest.mark.parametrize("reader", ["C", "Python"])
def test_unmoved_tensors_are_decided_by_the_fast_path(
    reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the check's verdict and the pointers (one C call where kvmgr's C module builds) decide
    # unmoved tensors: the four-list compare never runs; a moved pointer still reaches it
    _no_shim(monkeypatch)
    kv = _kv("cpu")
    tensor_guard = TensorGuard(kv)
    if reader == "C":
        if _native.checked_data_ptrs() is _native._python_checked_ptrs:
            pytest.skip("kvmgr's C module does not build here")
        assert tensor_guard._read is _native.checked_data_ptrs()
    else:
        tensor_guard._read = _native._python_checked_ptrs
    compared: list[str | None] = []
    compare = tensor_guard._compare
    monkeypatch.setattr(
        tensor_guard, "_compare", lambda: compared.append(compare()) or compared[-1]
    )
    for _ in range(3):
        assert tensor_guard.moved() is None
    assert compared == []
    _set_storage(kv)  # the same shape and strides (the check passes), another pointer
    assert tensor_guard.moved().startswith("KV tensor 1 moved")
    assert len(compared) == 1
