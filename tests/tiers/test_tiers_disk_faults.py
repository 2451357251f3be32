"""Disk-tier faults that must not become outages (issue 26, section 2), on real filesystems: a
small tmpfs that fills up, an ext4 loop mount frozen with fsfreeze (a stuck disk), two processes
on one file, damaged saved indexes (tests/mounts.py; root, as in CI)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from tiers_server import random_cpu_tensors

from kvmgr.errors import TierFullError, TierTimeoutError, TierUnavailableError
from kvmgr.tiers import DiskTier, TierBridge, TierNamespace

PAGES = (4096, 4096)
NS = TierNamespace("disk/faults", PAGES, ("bfloat16", "bfloat16"), 16)
SLOT = -(-NS.blob_bytes // 4096) * 4096  # 12 KiB


def _keys(n: int, tag: bytes = b"") -> list[bytes]:
    return [b"blk-" + tag + i.to_bytes(4, "little") for i in range(n)]


def _fill(directory: Path, leave_bytes: int = 0) -> None:
    """Fill the filesystem of ``directory`` to the last byte, then free ``leave_bytes``."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 16, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\xaa" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        if leave_bytes:
            os.ftruncate(fd, os.fstat(fd).st_size - leave_bytes)
    finally:
        os.close(fd)


def _punch_holes(path: Path, num_bytes: int) -> str | None:
    """Deallocate the first ``num_bytes`` of ``path`` (``fallocate --punch-hole``); the error
    text if the tool or the filesystem cannot."""
    done = subprocess.run(["fallocate", "--punch-hole", "--offset", "0", "--length",
                           str(num_bytes), str(path)], capture_output=True, text=True)  # fmt: skip
    return done.stderr.strip() or "failed" if done.returncode else None


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvmgr-disk")]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.asyncio
async def test_aclose_on_a_full_filesystem_is_typed_and_leaks_nothing(small_tmpfs) -> None:
    """Before: an untyped OSError from saving the index, the file and the thread pool left open,
    and PATH.index.tmp left behind."""
    root = small_tmpfs(1 << 20)
    fds = _fds()
    tier = DiskTier(root / "tier.bin", slot_bytes=NS.blob_bytes, num_slots=64, direct=False)
    bridge = TierBridge(random_cpu_tensors(PAGES, 16, seed=1), tier, NS)
    assert (await bridge.demote(_keys(16), range(16))).all()
    _fill(root)
    with pytest.raises(TierFullError, match="index not saved"):
        await tier.aclose()
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("tier")) == ["tier.bin"]
    assert _fds() == fds and not _threads()
    await tier.aclose()  # idempotent


def test_a_failed_preallocation_is_typed_and_leaves_no_file(small_tmpfs) -> None:
    """Before: posix_fallocate failed, ftruncate made a sparse file that failed writes later."""
    root = small_tmpfs(1 << 20)
    with pytest.raises(TierFullError, match="preallocate"):
        DiskTier(root / "tier.bin", slot_bytes=NS.blob_bytes, num_slots=512, direct=False)
    assert not list(root.iterdir())


@pytest.mark.asyncio
async def test_a_write_cut_short_by_a_full_disk_is_tier_full(small_tmpfs) -> None:
    """The tier's file loses its preallocation (holes punched, as thin storage or another
    process may do) and the filesystem fills up: a batch's write stops part-way. Before: the
    short count became a plain TierError (EIO); now the write continues until the kernel says
    ENOSPC: TierFullError, counted, and none of the batch readable."""
    root = small_tmpfs(2 << 20)
    tier = DiskTier(root / "tier.bin", slot_bytes=NS.blob_bytes, num_slots=32, direct=False)
    cpu = random_cpu_tensors(PAGES, 32, seed=2)
    bridge = TierBridge(cpu, tier, NS)
    failed = _punch_holes(root / "tier.bin", 32 * SLOT)
    if failed:
        pytest.skip(f"fallocate --punch-hole: {failed}")
    _fill(root, leave_bytes=2 * SLOT)  # room for two of the eight slots
    keys = _keys(8)
    with pytest.raises(TierFullError):
        await tier.put_many(NS.stored_keys(keys), [b"\x01" * NS.blob_bytes] * 8)
    assert tier.statistics().num_full == 8
    assert not (await tier.contains_many(NS.stored_keys(keys))).any()
    assert not (await bridge.demote(_keys(4, b"b"), range(4))).any()
    with pytest.raises(TierFullError):  # (and the index cannot be saved either)
        await tier.aclose()


@pytest.mark.asyncio
async def test_aclose_on_a_stuck_disk_is_bounded(frozen_ext4) -> None:
    """A frozen filesystem (fsfreeze): every write blocks in the kernel. Before: aclose waited
    for the stuck write with no bound. Now it returns after deadline_s with TierTimeoutError,
    without saving the index; the files close when the stuck write returns (after the thaw)."""
    fds = _fds()
    tier = DiskTier(frozen_ext4.path / "tier.bin", slot_bytes=NS.blob_bytes, num_slots=64,
                    deadline_s=0.5)  # fmt: skip
    cpu = random_cpu_tensors(PAGES, 16, seed=3)
    bridge = TierBridge(cpu, tier, NS)
    assert (await bridge.demote(_keys(4), range(4))).all()
    frozen_ext4.freeze()
    try:
        t0 = time.perf_counter()
        assert not (await bridge.demote(_keys(4, b"stuck"), range(4, 8))).any()  # its deadline
        with pytest.raises(TierTimeoutError, match="stuck"):
            await asyncio.wait_for(tier.aclose(), 5.0)  # (the old code: asyncio.TimeoutError)
        assert time.perf_counter() - t0 < 3.0
        assert _fds() > fds  # the stuck write still holds its file
    finally:
        frozen_ext4.thaw()
    for _ in range(200):  # the write returns, the last call closes the files
        if _fds() == fds:
            break
        await asyncio.sleep(0.01)
    assert _fds() == fds
    assert not (frozen_ext4.path / "tier.bin.index").exists()


_HOLDER = """
import sys
from kvmgr.tiers import DiskTier
tier = DiskTier(sys.argv[1], slot_bytes=int(sys.argv[2]), num_slots=8, direct=False)
print("open", flush=True)
sys.stdin.readline()
"""


def test_two_tiers_on_one_file_are_refused(tmp_path) -> None:
    """Before: two processes opened one file and overwrote each other's slots."""
    path = tmp_path / "tier.bin"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path), str(NS.blob_bytes)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(TierUnavailableError, match="in use by another"):
            DiskTier(path, slot_bytes=NS.blob_bytes, num_slots=8, direct=False)
        assert path.exists()  # the other tier's file is left alone
    finally:
        holder.communicate("\n", timeout=30)
    tier = DiskTier(path, slot_bytes=NS.blob_bytes, num_slots=8, direct=False)  # free again
    with pytest.raises(TierUnavailableError, match="in use by another"):
        DiskTier(path, slot_bytes=NS.blob_bytes, num_slots=8, direct=False)  # same process
    asyncio.run(tier.aclose())


@pytest.mark.parametrize(
    "damage",
    [
        "[]",
        "null",
        "{}",
        '{"geometry": GEOMETRY}',
        '{"geometry": GEOMETRY, "entries": {"a": 1}}',
        '{"geometry": GEOMETRY, "entries": [["zz-not-hex", 0, 100]]}',
        '{"geometry": GEOMETRY, "entries": [["00ff", "0", 100]]}',
        '{"geometry": GEOMETRY, "entries": [["00ff", 0]]}',
        '{"geometry": GEOMETRY, "entries": [null]}',
        '{"geometry": GEOMETRY, "entries": [["00ff", 0, 100], ["00fe", 0, 100]]}',
        "{not json",
    ],
)
def test_a_damaged_index_starts_empty_and_is_kept(tmp_path, damage: str) -> None:
    """Before: a saved index that was damaged but valid JSON made DiskTier() raise
    AttributeError/KeyError/ValueError/TypeError, after the file had been unlinked."""
    path = tmp_path / "tier.bin"
    tier = DiskTier(path, slot_bytes=NS.blob_bytes, num_slots=8, direct=False)
    asyncio.run(tier.aclose())
    index = tmp_path / "tier.bin.index"
    geometry = json.loads(index.read_text())["geometry"]
    index.write_text(damage.replace("GEOMETRY", json.dumps(geometry)))
    tier = DiskTier(path, slot_bytes=NS.blob_bytes, num_slots=8, direct=False)
    assert tier.num_used == 0
    assert (tmp_path / "tier.bin.index.invalid").exists() and not index.exists()
    asyncio.run(tier.aclose())


@pytest.mark.asyncio
async def test_a_valid_index_still_restores_the_tier(tmp_path) -> None:
    path = tmp_path / "tier.bin"
    cpu = random_cpu_tensors(PAGES, 8, seed=4)
    tier = DiskTier(path, slot_bytes=NS.blob_bytes, num_slots=8, direct=False)
    assert (await TierBridge(cpu, tier, NS).demote(_keys(3), [0, 1, 2])).all()
    await tier.aclose()
    again = DiskTier(path, slot_bytes=NS.blob_bytes, num_slots=8, direct=False)
    assert (await TierBridge(cpu, again, NS).promote(_keys(3), [3, 4, 5])).all()
    assert all(np.array_equal(t.numpy()[[3, 4, 5]], t.numpy()[[0, 1, 2]]) for t in cpu)
    assert not list(tmp_path.glob("*.index*"))
    await again.aclose()
