"""The driver's entry points called from C (``kvmgr.transfer.driver_call``): every argument
reaches the entry point as the 64-bit value given, its result comes back, and ``CopyDriver``
makes the same calls, with the same results and errors, from C and through ctypes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda_fakes import FakeDriverLib

from kvmgr.errors import TransferError
from kvmgr.transfer import driver_call
from kvmgr.transfer.driver import CopyDriver

call = driver_call.native_call()
needs_c = pytest.mark.skipif(call is None, reason="the C module does not build here (no Triton)")
_U = ctypes.c_uint64


@needs_c
@pytest.mark.parametrize("arity", [2, 3, 4, 8, 9])
def test_call_passes_every_argument_and_returns_the_result(arity: int) -> None:
    seen: list[tuple[int, ...]] = []
    proto = ctypes.CFUNCTYPE(ctypes.c_int, *([_U] * arity))
    entry = proto(lambda *args: seen.append(args) or 37)
    values = [(1 << 64) - 1 - i if i % 2 else 0x7F00_0000_1000 + i for i in range(arity)]
    assert call(ctypes.cast(entry, ctypes.c_void_p).value, *values) == 37
    assert seen == [tuple(values)]


@needs_c
def test_call_refuses_other_arities_and_a_null_entry_before_calling() -> None:
    with pytest.raises(TypeError, match="2, 3, 4, 8 or 9"):
        call(1, 2)
    with pytest.raises(TypeError, match="2, 3, 4, 8 or 9"):
        call(1, 2, 3, 4, 5, 6)
    with pytest.raises(ValueError, match="NULL"):
        call(0, 1, 2, 3, 4)
    with pytest.raises(TypeError):
        call(1, 2, 3, 4, "five")


def test_the_kill_switch_keeps_ctypes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMGR_NATIVE_LAUNCH", "0")
    driver_call._module.cache_clear()
    try:
        assert driver_call.native_call() is None and driver_call.native_context() is None
        lib = FakeDriverLib()
        assert CopyDriver(lib.resolver(), driver_version=13000)._call is None
    finally:
        monkeypatch.delenv("KVMGR_NATIVE_LAUNCH")
        driver_call._module.cache_clear()


FROM_C = [pytest.param(True, id="from C", marks=needs_c), pytest.param(False, id="ctypes")]


@pytest.mark.parametrize("from_c", FROM_C)
@pytest.mark.parametrize("abi", [12080, 13000])
def test_batch_and_memcpy_copy_the_same_from_c_and_ctypes(abi: int, from_c: bool) -> None:
    lib = FakeDriverLib()
    driver = CopyDriver(lib.resolver((abi,)), driver_version=13000, from_c=from_c)
    assert (driver._call is not None) is from_c
    rng = np.random.default_rng(abi)
    src = rng.integers(0, 256, 4 * 64, dtype=np.uint8)
    dst = np.full(4 * 64 + 64, 0xA5, dtype=np.uint8)  # poisoned, one page more than written
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    table = np.array([[base_s + 64 * i for i in (2, 0, 3)], [base_d + 64 * i for i in (0, 1, 2)],
                      [64, 64, 64]], dtype=np.int64)  # fmt: skip
    driver.batch_at(table[1].ctypes.data, table[0].ctypes.data, table[2].ctypes.data, 3, 0x7F00, 1)
    driver.memcpy(base_d + 3 * 64, base_s + 64, 64, 0x7F00)
    expected = np.concatenate([src[128:192], src[0:64], src[192:256], src[64:128]])
    assert np.array_equal(dst[:256], expected) and bool((dst[256:] == 0xA5).all())
    batch = [c for c in lib.calls if "batch" in c]
    assert batch == [{"batch": abi, "count": 3, "order": 1, "stream": 0x7F00, "idxs": [0],
                      "num_attrs": 1}]  # fmt: skip
    assert [c for c in lib.calls if "loop" in c] == [{"loop": 0, "stream": 0x7F00}]


@pytest.mark.parametrize("from_c", FROM_C)
def test_refusals_report_the_same_from_c_and_ctypes(from_c: bool) -> None:
    for abi, expected in ((12080, 4), (13000, None)):
        lib = FakeDriverLib(fail_at=4)
        driver = CopyDriver(lib.resolver((abi,)), driver_version=13000, from_c=from_c)
        addrs = np.arange(8, dtype=np.int64) * 64 + 4096
        with pytest.raises(TransferError, match="cuMemcpyBatchAsync") as info:
            driver.copy("batch", addrs, addrs, np.full(8, 16), 0x7F00, 3)
        assert info.value.fail_index == expected
    lib = FakeDriverLib(fail_at=0)
    driver = CopyDriver(lib.resolver(), driver_version=13000, from_c=from_c)
    with pytest.raises(TransferError, match="cuMemcpyAsync"):
        driver.memcpy(4096, 8192, 16, 0x7F00)
