"""What the scheduler side hands a transfer worker, and what comes back: jobs in block ids.

Offers:
    Direction     ``D2H`` (GPU -> CPU, a store) or ``H2D`` (CPU -> GPU, a load)
    KVGeometry    the torch-free shape of a KV cache the scheduler needs: blocks, page bytes,
                  and how ranks share a page (``"heads"`` split or ``"replicated"``)
    TransferJob   one batch of block copies of one direction, rank-agnostic
    JobOutcome    a job's end: success, or the typed error and the rank that caused it

A job names blocks, never addresses: every rank turns it into its own pointer plan over its own
tensors (``kvmgr.worker.TransferWorker``). A job completes only when every rank has reported
success; the transport (``kvmgr.transport``) folds the ranks' reports into one ``JobOutcome``.
Nothing here imports torch.
"""

from __future__ import annotations

import attrs
import numpy as np

from kvmgr._direction import Direction
from kvmgr.errors import GeometryError

__all__ = ["Direction", "JobOutcome", "KVGeometry", "TransferJob"]


#: How the ranks of a tensor-parallel group share one page of the KV cache.
LAYOUTS = ("heads", "replicated")


@attrs.frozen
class KVGeometry:
    """The shape of one rank's KV cache, as the scheduler sees it (no tensors, no devices).

    Attributes:
        num_gpu_blocks: GPU blocks per KV tensor (dim 0 of every tensor).
        page_bytes: bytes of one block in each KV tensor, on one rank.
        layout: ``"heads"``: each rank holds its own 1/TP of the heads (GQA; every rank copies
            every block); ``"replicated"``: every rank holds the same latent cache (MLA; one
            rank writes a block to the shared CPU tier, every rank loads it).
        num_ranks: ranks in the group (1 without tensor parallelism).

    Raises:
        GeometryError: no tensors, a non-positive size, or an unknown layout.
    """

    num_gpu_blocks: int
    page_bytes: tuple[int, ...]
    layout: str = "heads"
    num_ranks: int = 1

    def __attrs_post_init__(self) -> None:
        if self.num_gpu_blocks < 1:
            raise GeometryError(f"expected num_gpu_blocks >= 1, got {self.num_gpu_blocks}")
        if not self.page_bytes or min(self.page_bytes) < 1:
            raise GeometryError(f"expected page bytes >= 1 per tensor, got {self.page_bytes}")
        if self.layout not in LAYOUTS:
            raise GeometryError(f"expected a layout in {LAYOUTS}, got {self.layout!r}")
        if self.num_ranks < 1:
            raise GeometryError(f"expected num_ranks >= 1, got {self.num_ranks}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across this rank's tensors."""
        return sum(self.page_bytes)

    def writer(self, cpu_block_ids: np.ndarray) -> np.ndarray:
        """int64 ``[n]``: the rank that stores each CPU block under ``"replicated"`` (rotating by
        block id, as vLLM's canonical layout does); under ``"heads"`` every rank stores, and
        this is never asked."""
        return np.asarray(cpu_block_ids, dtype=np.int64) % self.num_ranks


@attrs.define(eq=False)
class TransferJob:
    """One batch of copies of one direction, named in block ids (rank-agnostic).

    Not frozen (a frozen attrs ``__init__`` costs ~3x on the step's path): read-only by use.

    Attributes:
        job_id: the scheduler's sequence number (submission order, unique per scheduler).
        direction: D2H (store/preempt) or H2D (load/resume).
        gpu_ids: int64 ``[n]``: GPU blocks read (D2H) or written (H2D).
        cpu_ids: int64 ``[n]``: CPU blocks written (D2H) or read (H2D), aligned with
            ``gpu_ids``.
        wait_for: ids of earlier jobs (of the other direction, still in flight) this one must
            start after on every rank: they touch some of the same GPU blocks.
    """

    job_id: int
    direction: Direction
    gpu_ids: np.ndarray
    cpu_ids: np.ndarray
    wait_for: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        """Blocks copied."""
        return len(self.gpu_ids)


@attrs.define(eq=False)
class JobOutcome:
    """How a job ended, folded over every rank.

    Not frozen (a frozen attrs ``__init__`` costs ~3x on the step's path): read-only by use.

    Attributes:
        job_id: the job.
        error: ``None`` when every rank succeeded; else the typed error (a ``TransferError``,
            ``RankError`` naming the rank, ``StaleKVTensorError``, ...).
        num_bytes: bytes copied, summed over ranks.
        device_s: the slowest rank's copy seconds, or ``None`` if not measured.
        results: the per-rank engine results where the transport keeps them (in process: the
            one ``BatchResult``), else ``()``.
    """

    job_id: int
    error: BaseException | None = None
    num_bytes: int = 0
    device_s: float | None = None
    results: tuple[object, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether every rank succeeded."""
        return self.error is None
