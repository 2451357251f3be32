"""The scheduler side of failed stores: sequence numbers of the stores in flight, and which of
their chunks a rank reported failed (through the fault table, module ``_fault_table``).

Private to ``kvmgr.integrations.vllm``.

Offers:
    KvmgrChunkSpec   vLLM's ``CPULoadStoreSpec`` plus the number of the store writing it
    StoreSeqs        the number of every chunk's store; splits a completed store into the
                     chunks that landed and the ones that failed
"""

from __future__ import annotations

import array
import secrets
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvmgr.integrations.vllm._fault_table import FaultTable

__all__ = ["KvmgrChunkSpec", "StoreSeqs"]

_K = TypeVar("_K")


class KvmgrChunkSpec(CPULoadStoreSpec):
    """vLLM's ``CPULoadStoreSpec`` (``block_ids``: int32 CPU chunk ids, in the job's order)
    plus ``store_seq``: the sequence number of the store writing them (0 for a load), which a
    worker writes into the fault table when its copy fails."""

    def __init__(self, block_ids: list[int], store_seq: int = 0) -> None:
        super().__init__(block_ids)
        self.store_seq = store_seq


class StoreSeqs:
    """Sequence numbers of the stores into each chunk, and the chunks whose store failed.

    Args:
        num_chunks: chunks of the CPU tier.
        faults: the engine's fault table (``None``: no rank reports a failed store).

    Sequence numbers start at a random 40-bit offset (unique per manager: module
    ``_fault_table``).
    """

    def __init__(self, num_chunks: int, faults: FaultTable | None) -> None:
        self.faults = faults
        self._num_faults_seen = faults.num_faults() if faults is not None else 0
        self._failed: set[int] = set()  # PENDING chunks whose store failed on some rank
        self._seq = array.array("q", [0]) * max(1, num_chunks)  # store number of each chunk
        self._seq_of_chunk = np.frombuffer(self._seq, dtype=np.int64)
        self._next_seq = (secrets.randbits(40) << 20) + 1

    def number(self, ids: list[int]) -> int:
        """A new store writes chunks ``ids``: its sequence number."""
        seq = self._next_seq
        self._next_seq += 1
        chunk_seq = self._seq
        for chunk in ids:  # a loop: map(array.__setitem__) costs more per id
            chunk_seq[chunk] = seq
        return seq

    def split(
        self, pending: list[tuple[_K, int]], success: bool, is_pending: Callable[[int], bool]
    ) -> tuple[list[tuple[_K, int]], list[tuple[_K, int]]]:
        """``(landed, failed)`` of a completed store's ``(key, chunk)`` pairs (its PENDING
        chunks): all failed without ``success``, else those a rank reported. ``is_pending``
        tells which chunks are PENDING (a fault scan keeps only those)."""
        faults = self.faults
        if faults is not None and faults.num_faults() != self._num_faults_seen:
            self._num_faults_seen = faults.num_faults()
            hit = faults.failed_chunks(self._seq_of_chunk)
            self._failed.update(int(b) for b in hit if is_pending(int(b)))
        if success and not self._failed:
            return pending, []
        bad = self._failed
        failed = [(k, b) for k, b in pending if not success or b in bad]
        landed = [(k, b) for k, b in pending if success and b not in bad]
        bad.difference_update(b for _, b in failed)
        return landed, failed

    def forget(self, ids: np.ndarray | None = None) -> None:
        """Chunks ``ids`` (``None``: every chunk) hold no store any more."""
        if ids is None:
            self._seq_of_chunk[:] = 0
            self._failed.clear()
        else:
            self._seq_of_chunk[ids] = 0

    def close(self) -> None:
        """Close (and unlink) the fault table."""
        if self.faults is not None:
            self.faults.close(unlink=True)
            self.faults = None
