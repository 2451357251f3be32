"""The lower tiers of a simulated instance: a scratch disk tier and a shared tier client.

Offers:
    instance_tiers      one instance's lower tiers, nearest first
    tier_namespace      the namespace an instance's blocks are written under
    disk_file           the scratch file of an instance's disk tier
    remove_disk_files   delete a disk tier's scratch file and saved index
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvmgr.sim.config import SimConfig

__all__ = ["disk_file", "instance_tiers", "remove_disk_files", "tier_namespace"]


def tier_namespace(config: SimConfig, page_bytes: int, num_tensors: int) -> Any:
    """The ``TierNamespace`` every instance of a run writes its blocks under."""
    from kvmgr.tiers import TierNamespace

    return TierNamespace(
        model=f"sim-{config.model}",
        page_bytes=(page_bytes,) * num_tensors,
        dtype_names=("uint8",) * num_tensors,
        block_size=config.block_size,
    )


def disk_file(disk_path: str | Path, index: int) -> Path:
    """The scratch file of instance ``index``'s disk tier in the folder ``disk_path``."""
    return Path(disk_path) / f"kvmgr-sim-instance-{index}.bin"


def remove_disk_files(path: Path) -> bool:
    """Delete a disk tier's scratch file and its saved index; whether any existed."""
    found = False
    for p in (path, path.with_name(path.name + ".index")):
        if p.exists():
            p.unlink()
            found = True
    return found


def instance_tiers(
    index: int,
    shared_url: str | None,
    disk_path: str | None,
    disk_tokens: int | None,
    config: SimConfig,
    block_bytes: int,
) -> list[Any]:
    """Instance ``index``'s lower tiers, nearest first: a fresh ``DiskTier`` in ``disk_path``
    (``disk_tokens`` of capacity, 50M when ``None``) and a ``SharedTier`` on ``shared_url``."""
    tiers: list[Any] = []
    if disk_path is not None:
        from kvmgr.tiers import DiskTier
        from kvmgr.tiers.blob import HEADER_BYTES

        slots = -(-(disk_tokens or 50_000_000) // config.block_size)
        path = disk_file(disk_path, index)
        remove_disk_files(path)  # a previous run's blocks must not make this run start warm
        tiers.append(
            DiskTier(
                path,
                slot_bytes=HEADER_BYTES + block_bytes,
                num_slots=slots,
                persist_index=False,
            )
        )
    if shared_url is not None:
        from kvmgr.tiers import SharedTier

        tiers.append(SharedTier(shared_url, single_tenant=True))  # one simulated tenant
    return tiers
