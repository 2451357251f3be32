"""The copy kernels' host staging (``kvmgr.kernels.copy.staging.CopyStager``): one pooled slot
serving tables of every kind in turn. The 1s row of one-block runs is kept in a slot between
tables of the same size (``TableSlot.ones``); every table the kernel would read must still be
exactly ``[src, dst, lengths]`` (or ``[src, dst, bytes]``), whatever the slot held before
(poisoned at first)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
import torch
from cuda_fakes import cpu_table_slot

from kvmgr.kernels.copy import staging
from kvmgr.pool.layout import KVLayout

POISON = -7


class _Stream:
    cuda_stream = 0x5100


@pytest.fixture
def stager(monkeypatch: pytest.MonkeyPatch) -> tuple[staging.CopyStager, list[np.ndarray]]:
    """A CPU stager whose upload is a memmove and whose launches record the table read."""
    seen: list[np.ndarray] = []
    monkeypatch.setattr(staging, "new_table_slot", cpu_table_slot)
    monkeypatch.setattr(staging, "block_table_launches", lambda: "runs")
    monkeypatch.setattr(staging, "copy_table_launches", lambda: "descriptors")

    def launch_runs(layout: torch.Tensor, runs: torch.Tensor, t: int, n: int, programs: int, **_: Any) -> int:  # fmt: skip
        seen.append(runs[: 3 * n].numpy().reshape(3, n).copy())
        return min(t * n, programs)

    def launch_descriptors(table: torch.Tensor, n: int, programs: int, **_: Any) -> int:
        seen.append(table[: 3 * n].numpy().reshape(3, n).copy())
        return min(n, programs)

    monkeypatch.setattr(staging, "launch_block_table", launch_runs)
    monkeypatch.setattr(staging, "launch_copy_table", launch_descriptors)
    upload = lambda dst, src, num_bytes, stream: ctypes.memmove(dst, src, num_bytes)  # noqa: E731
    return staging.CopyStager(torch.device("cpu"), upload, chunk_bytes=1 << 20), seen


def test_one_pooled_slot_serves_every_table_kind_exactly(stager: Any) -> None:
    copier, seen = stager
    rng = np.random.default_rng(5)
    tensors = [torch.zeros((64, 512), dtype=torch.uint8) for _ in range(2)]
    src, dst = KVLayout.from_tensors(tensors), KVLayout.from_tensors([t.clone() for t in tensors])
    slot = copier.slots.take(5)
    slot.rows[:] = POISON  # the host side and the "device" side poisoned
    slot.device[:] = POISON
    copier.slots.give(slot)

    def ids(n: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.choice(64, n, replace=False).astype(np.int64), rng.choice(64, n, replace=False).astype(np.int64)  # fmt: skip

    steps: list[tuple[str, int]] = [("one", 5), ("one", 5), ("runs", 5), ("one", 5), ("one", 3),
                                    ("one", 5), ("descriptors", 5), ("one", 5), ("runs", 3),
                                    ("one", 3)]  # fmt: skip
    for kind, n in steps:
        s, d = ids(n)
        if kind == "descriptors":
            sizes = rng.integers(1, 4096, n).astype(np.int64)
            staged = copier.copy_descriptors(s, d, sizes, 8, _Stream())
            expected = np.stack((s, d, sizes))
        else:
            lengths = None if kind == "one" else rng.integers(2, 4, n).astype(np.int64)
            staged = copier.copy_runs(src, dst, s, d, lengths, 8, _Stream())
            expected = np.stack((s, d, np.ones(n, np.int64) if lengths is None else lengths))
        assert staged.error is None and staged.num_launches == 1
        assert staged.keep_alive[-1] is slot  # the one pooled slot, every time
        np.testing.assert_array_equal(seen[-1], expected, err_msg=f"{kind} {n}")
        staged.release()  # the batch "ended": the slot goes back
    assert copier.slots.num_allocated == 1


def test_a_slot_in_flight_is_never_handed_out_again(stager: Any) -> None:
    copier, seen = stager
    tensors = [torch.zeros((16, 256), dtype=torch.uint8)]
    layout = KVLayout.from_tensors(tensors)
    first = copier.copy_runs(layout, KVLayout.from_tensors([tensors[0].clone()]),
                             np.arange(4), np.arange(4, 8), None, 4, _Stream())  # fmt: skip
    table = seen[-1].copy()
    second = copier.copy_runs(layout, KVLayout.from_tensors([tensors[0].clone()]),
                              np.arange(8, 12), np.arange(12, 16), None, 4, _Stream())  # fmt: skip
    assert second.keep_alive[-1] is not first.keep_alive[-1]  # the first is still in flight
    # the first batch's table is what it was when its launch read it
    read_back = first.keep_alive[-1].rows[:12].reshape(3, 4)
    np.testing.assert_array_equal(read_back, table)
    first.release()
    second.release()
    assert copier.slots.num_allocated == 2
