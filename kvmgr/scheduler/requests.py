"""Request-level bookkeeping: block tables, allocate / append / free, preempt and resume.

Private to ``kvmgr.scheduler``. A request is *resident* (every block on the GPU), *swapped out*
(every block in CPU blocks in state ``SWAPPED``) or *moving* (a preempt or resume in flight:
``BlockTable.moving``). Blocks are appended only while resident. ``prepare_preempt`` /
``prepare_resume`` build the ``Part`` the queue carries; ``preempt_done`` / ``resume_done``
apply the outcome. Between the two the request's table is marked moving, its GPU blocks are
busy, and its CPU blocks are ``PREEMPTING`` or ``RESUMING``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from kvmgr.errors import (
    BlockStateError,
    ConfigError,
    InvalidArgumentError,
    InvalidBlockError,
    PoolExhaustedError,
    UnknownRequestError,
)
from kvmgr.pool.block_ids import as_id_array
from kvmgr.pool.block_table import BlockTable, Tier
from kvmgr.reports import SwapResult
from kvmgr.scheduler.counters import Counters
from kvmgr.scheduler.cpu_tier import CpuState, CpuTier
from kvmgr.scheduler.gpu_blocks import GpuBlocks
from kvmgr.scheduler.queue import Kind, Part

#: why a freed block may not be free yet (appended to the gpu_full messages)
DRAINING_HINT = "a freed block still used by a queued or in-flight copy returns when it ends"

__all__ = ["RequestTables"]


def check_req_id(req_id: object) -> None:
    """Raises InvalidArgumentError: ``req_id`` is not hashable."""
    try:
        hash(req_id)
    except TypeError:
        raise InvalidArgumentError(
            f"expected a hashable request id, got {type(req_id).__name__}"
        ) from None


def check_count(num_blocks: object) -> int:
    """Raises InvalidArgumentError: not an int >= 0."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
        raise InvalidArgumentError(f"expected an int number of blocks, got {num_blocks!r}")
    if num_blocks < 0:
        raise InvalidArgumentError(f"expected a number of blocks >= 0, got {num_blocks}")
    return int(num_blocks)


class RequestTables:
    """Block tables of the requests, over the CPU tier and the GPU blocks."""

    def __init__(self, cpu: CpuTier, gpu: GpuBlocks, block_bytes: int, counters: Counters) -> None:
        self.cpu = cpu
        self.counters = counters
        self.gpu = gpu
        self.block_bytes = block_bytes
        self.tables: dict[Hashable, BlockTable] = {}

    def lookup(self, req_id: Hashable) -> BlockTable:
        """The request's table, moving or not.

        Raises:
            InvalidArgumentError, UnknownRequestError.
        """
        check_req_id(req_id)
        table = self.tables.get(req_id)
        if table is None:
            raise UnknownRequestError(f"request {req_id!r} has no block table")
        return table

    def table(self, req_id: Hashable) -> BlockTable:
        """The request's table, not moving.

        Raises:
            InvalidArgumentError, UnknownRequestError, BlockStateError.
        """
        table = self.lookup(req_id)
        if table.moving:
            raise BlockStateError(f"request {req_id!r} has a preempt or resume in flight")
        return table

    def _owned_blocks(self, n: int, advice: str) -> np.ndarray:
        """``n`` blocks from the owned GPU pool (int64 ``[n]``).

        Raises:
            PoolExhaustedError: fewer are free (nothing changed; ``advice`` says what to do).
        """
        ids = self.gpu.allocate(n)
        if ids is None:
            assert self.gpu.pool is not None
            free = self.gpu.pool.num_free
            raise PoolExhaustedError(
                f"gpu: need {n} blocks, {free} free; nothing changed. {advice} ({DRAINING_HINT})",
                needed=n,
                available=free,
                reason="gpu_full",
            )
        return ids

    def _resident(self, req_id: Hashable) -> BlockTable:
        check_req_id(req_id)
        table = self.tables.get(req_id) or BlockTable(req_id)
        if table.moving or table.tier is not Tier.GPU:
            raise BlockStateError(f"request {req_id!r} is swapped out or moving")
        return table

    def allocate(self, req_id: Hashable, num_blocks: object) -> list[int]:
        """See ``OffloadManager.allocate``."""
        if self.gpu.pool is None:
            raise ConfigError("allocate() needs manage_gpu_blocks=True; use append_blocks()")
        n = check_count(num_blocks)
        table = self._resident(req_id)
        ids = self._owned_blocks(
            n,
            "Free finished requests (free()), preempt() one into the CPU tier, or allocate "
            "fewer blocks",
        )
        new = ids.tolist()
        table.block_ids.extend(new)
        table.gpu_owned = True
        self.tables[req_id] = table
        return new

    def append(self, req_id: Hashable, gpu_block_ids: Sequence[int]) -> None:
        """See ``OffloadManager.append_blocks``."""
        if self.gpu.pool is not None:
            raise ConfigError("append_blocks() needs manage_gpu_blocks=False; use allocate()")
        new = as_id_array(gpu_block_ids, "gpu", self.gpu.num_blocks)
        table = self._resident(req_id)
        every = np.concatenate([np.array(table.block_ids, dtype=np.int64), new])
        self.gpu.check_array(every, "block table")
        table.block_ids.extend(new.tolist())
        table.gpu_owned = False
        self.tables[req_id] = table

    def free(self, req_id: Hashable) -> None:
        """See ``OffloadManager.free``."""
        table = self.table(req_id)
        ids = np.array(table.block_ids, dtype=np.int64)
        if table.tier is Tier.CPU:
            self.cpu.release(ids)
        elif table.gpu_owned:
            self.gpu.give_back(ids)
        del self.tables[req_id]

    # ------------------------------------------------------------------ preempt

    def prepare_preempt(self, req_id: Hashable, future: asyncio.Future[Any]) -> Part:
        """Reserve CPU blocks for the request's GPU blocks and mark the table moving.

        Raises:
            UnknownRequestError, BlockStateError, PoolExhaustedError: nothing changed then.
        """
        table = self.table(req_id)
        if table.tier is not Tier.GPU:
            raise BlockStateError(f"request {req_id!r} is already swapped out")
        gpu = np.array(table.block_ids, dtype=np.int64)
        if not len(gpu):  # nothing to copy: swapped out at once (never left moving)
            table.tier = Tier.CPU
            return Part(Kind.PREEMPT, future, SwapResult(0, 0, 0, (), ()), gpu, gpu, None, req_id)
        cpu = self.cpu.make_room(len(gpu), ())
        self.cpu.set_state(cpu, CpuState.PREEMPTING)
        table.moving = True
        self.counters.stores_queued += len(gpu)
        self.gpu.acquire(gpu)
        result = SwapResult(
            len(gpu), len(gpu) * self.block_bytes, 0, tuple(cpu.tolist()), tuple(table.block_ids)
        )
        return Part(Kind.PREEMPT, future, result, gpu, cpu, None, req_id)

    def preempt_done(self, part: Part, ok: bool) -> None:
        """Apply a preempt's outcome (the CPU tier already moved its blocks' states)."""
        table = self.tables[part.req_id]
        table.moving = False
        if not ok:
            return
        table.tier, table.block_ids = Tier.CPU, part.cpu_ids.tolist()
        if table.gpu_owned:
            self.gpu.give_back(part.gpu_ids)

    # ------------------------------------------------------------------ resume

    def prepare_resume(
        self, req_id: Hashable, gpu_block_ids: Sequence[int] | None, future: asyncio.Future[Any]
    ) -> Part:
        """GPU blocks for a swapped-out request (owned pool, or the caller's); table moving.

        Raises:
            UnknownRequestError, BlockStateError, InvalidBlockError, PoolExhaustedError.
        """
        table = self.table(req_id)
        if table.tier is not Tier.CPU:
            raise BlockStateError(f"request {req_id!r} is not swapped out")
        cpu = np.array(table.block_ids, dtype=np.int64)
        if not len(cpu):  # nothing to copy: resident at once (never left moving)
            if gpu_block_ids is not None and len(
                as_id_array(gpu_block_ids, "gpu", self.gpu.num_blocks)
            ):
                raise InvalidBlockError("expected 0 gpu block ids: the request has no blocks")
            table.tier = Tier.GPU
            return Part(Kind.RESUME, future, SwapResult(0, 0, 0, (), ()), cpu, cpu, None, req_id)
        gpu = self._resume_blocks(table.gpu_owned, gpu_block_ids, len(cpu))
        self.cpu.set_state(cpu, CpuState.RESUMING)
        table.moving = True
        self.counters.loads_queued += len(cpu)
        self.gpu.acquire(gpu)
        result = SwapResult(
            len(cpu), len(cpu) * self.block_bytes, 0, tuple(table.block_ids), tuple(gpu.tolist())
        )
        return Part(Kind.RESUME, future, result, gpu, cpu, None, req_id)

    def _resume_blocks(
        self, owned: bool | None, gpu_block_ids: Sequence[int] | None, n: int
    ) -> np.ndarray:
        """The ``n`` GPU blocks a resume copies into (int64): from the owned pool (``owned``),
        else the caller's ``gpu_block_ids``, checked.

        Raises:
            InvalidBlockError, PoolExhaustedError: nothing changed.
        """
        if owned:
            if gpu_block_ids is not None:
                raise InvalidBlockError("this request's GPU blocks come from the owned pool")
            return self._owned_blocks(
                n, "Free finished requests (free()) or preempt() another one, then resume this one"
            )
        if gpu_block_ids is None:
            raise InvalidBlockError(f"expected {n} caller-owned gpu block ids")
        gpu: np.ndarray = as_id_array(gpu_block_ids, "gpu", self.gpu.num_blocks).copy()
        if len(gpu) != n:
            raise InvalidBlockError(f"expected {n} caller-owned gpu block ids, got {len(gpu)}")
        self.gpu.check_array(gpu, "resume")
        return gpu

    def resume_done(self, part: Part, ok: bool) -> None:
        """Apply a resume's outcome: the table points at the GPU blocks and the CPU blocks are
        freed, or (failure) the request stays swapped out and owned GPU blocks go back."""
        table = self.tables[part.req_id]
        table.moving = False
        if ok:
            self.cpu.release(part.cpu_ids)
            table.tier, table.block_ids = Tier.GPU, part.gpu_ids.tolist()
        else:
            self.cpu.set_state(part.cpu_ids, CpuState.SWAPPED)
            if table.gpu_owned:
                self.gpu.give_back(part.gpu_ids)
