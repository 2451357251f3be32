"""CPU-tier memory shared by the ranks of a group (the replicated, MLA layout).

``shared_host_pool`` maps one file (under ``/dev/shm`` for memory) as the CPU tier of every rank
that names it: the rank that writes a block (``KVGeometry.writer``) stores it once, and every
rank loads from the same pages.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from kvmgr.pool.host_pool import HostKVPool

__all__ = ["shared_host_pool"]


def shared_host_pool(path: str, page_bytes: Sequence[int], num_blocks: int) -> HostKVPool:
    """A ``HostKVPool`` over the file at ``path`` (created, or grown, to the region's size; every
    rank may call this at once). Not pinned: for the host engine and tests; the caller removes
    the file when the group is closed.

    Args:
        path: the file, e.g. ``/dev/shm/kvmgr-<run>``.
        page_bytes: bytes of one page of each KV tensor (one rank's).
        num_blocks: CPU blocks.

    Raises:
        OSError: the file cannot be created or mapped.
    """

    def allocate(num_bytes: int) -> torch.Tensor:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < num_bytes:
                os.ftruncate(fd, num_bytes)
        finally:
            os.close(fd)
        region = np.memmap(path, dtype=np.uint8, mode="r+", shape=(num_bytes,))
        return torch.from_numpy(region)

    return HostKVPool(list(page_bytes), num_blocks, allocate)
