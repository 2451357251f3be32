"""The fault table: how a worker tells the scheduler side that a store copy failed.

Private to ``kvmgr.integrations.vllm``.

vLLM 0.33's ``OffloadingConnector`` asserts that every ``TransferResult`` succeeded and always
calls ``complete_store(keys)`` with ``success=True``. kvmgr's worker therefore reports a failed
store to vLLM as finished and, before it does, writes the store's sequence number into this
table at every chunk the store was writing; the manager's ``complete_store`` reads the table and
drops the chunks whose entry equals their store's sequence number instead of marking them READY.

The table is a file mapping (``/dev/shm`` where it exists) named after vLLM's ``engine_id``, so
it is shared by the scheduler process and every worker process of one engine: ``int64
[world_size]`` fault counts (one per rank, written by that rank only), then ``int64 [world_size,
num_chunks]`` entries. Entry ``[rank, chunk]`` holds the sequence number of the last store into
``chunk`` that failed on ``rank`` (0: none); a rank writes the entries first, then its count, so
the scheduler side reads the entries only when a count moved (its per-store cost is one sum). Sequence numbers are unique per manager (they start
at a random 40-bit offset), so an entry left over by an earlier store, or by an earlier engine
with the same id, never matches a later store. The worker writes before it returns the result,
and vLLM delivers the result to the scheduler after that, so the scheduler reads a written entry.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["FaultTable", "fault_table_path"]


def fault_table_path(engine_id: str, directory: str | None = None) -> Path:
    """The table's file for vLLM engine ``engine_id`` (in ``directory``, else ``/dev/shm`` where
    it exists, else the temporary directory)."""
    if directory is None:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    digest = hashlib.blake2b(engine_id.encode(), digest_size=12).hexdigest()
    return Path(directory) / f"kvmgr-vllm-{digest}.faults"


class FaultTable:
    """Fault counts ``int64 [world_size]`` and entries ``int64 [world_size, num_chunks]``,
    shared by the processes of one engine.

    Args:
        path: the file (created if missing, grown to size if smaller; never shrunk, so a mapping
            another process holds stays valid).
        world_size: worker ranks.
        num_chunks: CPU chunks of the tier.

    Raises:
        OSError: the file cannot be created or mapped.
    """

    def __init__(self, path: Path, world_size: int, num_chunks: int) -> None:
        self.path = path
        self.shape = (max(1, world_size), max(1, num_chunks))
        num_bytes = 8 * self.shape[0] * (1 + self.shape[1])
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < num_bytes:
                os.ftruncate(fd, num_bytes)
            self._map: mmap.mmap | None = mmap.mmap(fd, num_bytes)
        finally:
            os.close(fd)
        flat = np.frombuffer(self._map, dtype=np.int64)
        self.counts = flat[: self.shape[0]]
        self._counts = memoryview(self._map).cast("q")[: self.shape[0]]  # fast scalar reads
        self.table = flat[self.shape[0] :].reshape(self.shape)

    def record(self, rank: int, chunk_ids: np.ndarray, seqs: np.ndarray) -> None:
        """Rank ``rank``'s stores with sequence numbers ``seqs`` into ``chunk_ids`` failed."""
        self.table[rank, chunk_ids] = seqs
        self.counts[rank] += len(chunk_ids)  # after the entries: a reader sees them

    def num_faults(self) -> int:
        """Faults recorded by every rank so far (only grows)."""
        return sum(self._counts)

    def failed_chunks(self, seq_of_chunk: np.ndarray) -> np.ndarray:
        """int64 chunk ids whose current store (``seq_of_chunk[c]``, 0: none) failed on a rank."""
        hit = (self.table == seq_of_chunk[None, :]).any(axis=0) & (seq_of_chunk != 0)
        return np.flatnonzero(hit)

    def close(self, *, unlink: bool = False) -> None:
        """Unmap the table (and remove its file with ``unlink``). Idempotent."""
        if self._map is not None:
            self._counts.release()
            del self.table, self.counts
            self._map.close()
            self._map = None
        if unlink:
            self.path.unlink(missing_ok=True)
