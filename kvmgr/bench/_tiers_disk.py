"""``kvmgr bench tiers``: the disk tier against fio at the same queue depth (private to
``kvmgr.bench.tiers``).

Offers:
    bench_disk   DiskTier (through ``TierBridge``) vs ``fio`` (libaio, the tier's I/O size and
                 queue depth, the same open mode), for one case and batch size
    fio_version  the installed fio's version, or ``None``

The tier stores a batch as runs of consecutive slots of up to 4 MiB, at most ``io_threads`` (4)
in flight: that is fio's ``--bs`` (the run) and ``--iodepth`` (``min(io_threads, runs per
batch)``), sequential, ``--direct=1`` when the tier opened its file with ``O_DIRECT``. fio moves
``rounds`` batches' bytes in each direction once before and once after the tier's rounds (mean
of the two runs, so both see the same machine). Ratio = the tier's slot bytes per second (what
the device moves: blobs rounded up to 4 KiB slots) / fio's bytes per second.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from kvmgr.bench._tiers_shared import Pages, timed_rounds
from kvmgr.tiers import DiskTier, TierBridge, TierNamespace
from kvmgr.tiers.disk import MAX_RUN_BYTES

__all__ = ["bench_disk", "fio_version"]


def fio_version() -> str | None:
    """``fio --version`` or ``None`` when fio is not installed."""
    if shutil.which("fio") is None:
        return None
    return subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()


def _fio(path: Path, direction: str, size: int, block: int, depth: int, direct: bool) -> float:
    """fio's bytes per second for one sequential pass (``direction``: ``write`` or ``read``)."""
    cmd = ["fio", "--name=kvmgr", f"--filename={path}", f"--size={size}", f"--bs={block}",
           f"--iodepth={depth}", "--ioengine=libaio", f"--direct={int(direct)}",
           f"--rw={direction}", "--numjobs=1", "--fallocate=native", "--output-format=json",
           "--invalidate=1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    job = json.loads(done.stdout[done.stdout.index("{") :])["jobs"][0]
    return float(job[direction]["bw_bytes"])


async def bench_disk(case: str, namespace: TierNamespace, batch: int, directory: Path,
                     rounds: int, buffered: bool) -> tuple[list[dict[str, Any]], bool]:  # fmt: skip
    """Rows ``tier=disk`` against ``ceiling=fio`` (or without a ratio when fio is missing)."""
    pages, tier_path = Pages(namespace, batch), directory / f"{case}-{batch}.bin"
    tier = DiskTier(tier_path, slot_bytes=namespace.blob_bytes, num_slots=2 * batch,
                    direct=not buffered)  # fmt: skip
    bridge = TierBridge(pages.pool.tensors, tier, namespace)
    slot = tier.slot_bytes
    run = min(batch * slot, max(1, MAX_RUN_BYTES // slot) * slot)
    depth = min(4, -(-batch * slot // run))
    fio_path, size = directory / f"{case}-{batch}.fio", rounds * batch * slot
    have_fio = fio_version() is not None
    fio = {"store": [], "load": []}

    def run_fio() -> None:
        for direction, rw in (("store", "write"), ("load", "read")) if have_fio else ():
            fio[direction].append(_fio(fio_path, rw, size, run, depth, tier.is_direct))

    async def store(keys: list[bytes]) -> bool:
        return bool((await bridge.demote(keys, np.arange(batch))).all())

    async def load(keys: list[bytes]) -> bool:
        return bool((await bridge.promote(keys, np.arange(batch, 2 * batch))).all())

    async def drop(keys: list[bytes]) -> None:
        await tier.delete_many(namespace.stored_keys(keys))

    try:
        run_fio()
        times, ok = await timed_rounds({"disk": (store, load)}, rounds, pages, case, drop)
        run_fio()
    finally:
        mode = tier.statistics().io_mode
        await tier.aclose()
        for p in (fio_path, tier_path, tier_path.with_name(tier_path.name + ".index")):
            p.unlink(missing_ok=True)
    label = f"fio libaio bs={run >> 10}K qd={depth}" if have_fio else "fio missing"
    per_block = {"tier": namespace.payload_bytes, "device": slot}
    return _rows(case, batch, f"disk ({mode})", times, fio, label, per_block), ok


def _rows(
    case: str, batch: int, tier: str, times: dict[str, list[float]],
    fio: dict[str, list[float]], ceiling: str, per_block: dict[str, int],
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per direction: the tier's median batch time and rate, against fio's mean rate
    where fio ran (ratio: the device's bytes per second, slots, over fio's)."""
    rows = []
    for direction in ("store", "load"):
        seconds = statistics.median(times[f"disk/{direction}"])
        row: dict[str, Any] = {
            "case": case, "batch_blocks": batch, "direction": direction, "tier": tier,
            "gbps": batch * per_block["tier"] / seconds / 1e9, "p50_ms": seconds * 1e3,
            "ceiling": ceiling,
        }  # fmt: skip
        if fio[direction]:
            fio_bps = sum(fio[direction]) / len(fio[direction])
            row["ceiling_gbps"] = fio_bps / 1e9
            row["ratio"] = batch * per_block["device"] / seconds / fio_bps
        rows.append(row)
    return rows
