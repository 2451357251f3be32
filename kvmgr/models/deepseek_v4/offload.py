"""Offload and restore a DeepSeek-V4 request at any token boundary, bit for bit.

Offers:
    DeepSeekV4Offload   stores / loads one request's live blocks of every group, one manager each
    allocate_caches     the GPU (or CPU) tensors of every group, ``[num_blocks, *block_shape]``
    boundary_keys       the CPU-tier keys of every group at a boundary

A restore point is a boundary ``N`` (tokens computed) of one request. What it holds, per group
(:class:`~kvmgr.models.deepseek_v4.layout.DeepSeekV4Layout`):

- ``compressed``: every block of the prefix. Block ``i < N // block_size`` is content-addressed
  by the caller's chained block hash (requests sharing the prefix share it); the partial last
  block, holding the compressed and indexer entries of the unfinished block, is keyed by the
  boundary.
- ``swa``, ``c4_state``, ``c128_state``: the blocks holding live positions only (the sliding
  window's last ``W - 1`` tokens, the compressor's partial windows), keyed by the boundary. This
  is the *sidecar* of the boundary: the compressor's partial-window state is copied, not
  recomputed (docs/hybrid-models.md says why).

Pages are copied whole, so a restore reproduces the GPU's bytes exactly (positions past ``N`` in
a loaded block are overwritten by the next steps before anything reads them).

Until one manager serves several cache groups (issue 28, section 1), each group has its own
manager, CPU pool and policy. So: a step submits one batch per group and direction; a store's
room is checked in every group before any queues (should a group still refuse, the future fails
once the queued copies ended); each policy evicts on its own, so a restore point can lose one
group while others keep theirs (:meth:`DeepSeekV4Offload.is_restorable` asks every group; a
restore point whose groups are not all READY is worth nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from kvmgr._futures import queue_all
from kvmgr.config import ManagerConfig
from kvmgr.errors import (
    GeometryError,
    InvalidArgumentError,
    InvalidBlockError,
    InvalidKeyError,
    UnknownKeyError,
)
from kvmgr.hooks import StepContext, StepHook
from kvmgr.manager import OffloadManager
from kvmgr.models.deepseek_v4._room import check_stores
from kvmgr.models.deepseek_v4.layout import DeepSeekV4Layout
from kvmgr.reports import StepReport

__all__ = ["DeepSeekV4Offload", "allocate_caches", "boundary_keys"]

_TORCH_DTYPES = {"uint8": torch.uint8, "float32": torch.float32}


def allocate_caches(
    layout: DeepSeekV4Layout, num_blocks: Mapping[str, int], *, device: torch.device | str = "cpu"
) -> dict[str, list[torch.Tensor]]:
    """Allocate (uninitialised) the tensors of every group: ``[num_blocks[group], *block_shape]``.

    Raises:
        InvalidArgumentError: a group of the layout has no block count, or one is < 1.
    """
    caches: dict[str, list[torch.Tensor]] = {}
    for group in layout.groups:
        n = num_blocks.get(group.name)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgumentError(
                f"num_blocks[{group.name!r}]: expected an int >= 1, got {n!r}"
            )
        caches[group.name] = [
            torch.empty((n, *t.block_shape), dtype=_TORCH_DTYPES[t.dtype], device=device)
            for t in group.tensors
        ]
    return caches


def _derived(boundary_key: bytes, group: str, index: int) -> bytes:
    """A boundary's key for block ``index`` of ``group`` (BLAKE2b-128)."""
    h = hashlib.blake2b(boundary_key, digest_size=16, person=b"kvmgr-dsv4")
    h.update(group.encode())
    h.update(index.to_bytes(8, "little"))
    return h.digest()


def boundary_keys(
    layout: DeepSeekV4Layout, num_tokens: int, block_keys: Sequence[bytes], boundary_key: bytes
) -> dict[str, list[bytes]]:
    """The keys of every group's live blocks at ``num_tokens`` (in :meth:`blocks_at` order).

    Args:
        layout: the model's cache layout.
        num_tokens: the boundary ``N`` (>= 1).
        block_keys: chained content hashes of the full compressed blocks of the prefix; at least
            ``N // layout.block_size`` of them (more are ignored).
        boundary_key: a hash of the whole ``N``-token prefix (it names the partial block and the
            window groups' blocks).

    Raises:
        InvalidArgumentError: ``num_tokens`` < 1.
        InvalidKeyError: too few block keys, or a key that is not non-empty bytes.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise InvalidArgumentError(f"num_tokens: expected an int >= 1, got {num_tokens!r}")
    num_full = num_tokens // layout.block_size
    if len(block_keys) < num_full:
        raise InvalidKeyError(
            f"block_keys: expected at least {num_full} keys, got {len(block_keys)}"
        )
    for key in (boundary_key, *block_keys[:num_full]):
        if not isinstance(key, bytes) or not key:
            raise InvalidKeyError(f"expected keys of non-empty bytes, got {key!r}")
    keys: dict[str, list[bytes]] = {}
    for group in layout.groups:
        blocks = layout.blocks_at(group.name, num_tokens)
        if group.name == "compressed":
            keys[group.name] = [block_keys[i] if i < num_full else _derived(boundary_key, group.name, i)
                                for i in blocks]  # fmt: skip
        else:
            keys[group.name] = [_derived(boundary_key, group.name, i) for i in blocks]
    return keys


class DeepSeekV4Offload:
    """One DeepSeek-V4 request's live blocks through the CPU tier, one manager per cache group.

    Use it as ``async with DeepSeekV4Offload.create(...) as offload:`` (enters every manager), or
    build it from entered managers. Ids are GPU block ids of each group's tensors, the caller's
    (``manage_gpu_blocks=False``): reuse one once its swap's future resolved (every group's copy
    ended), or if cancelled once its group manager's ``snapshot().gpu_busy`` no longer names it.

    Attributes:
        layout: the model's cache layout.
        managers: the ``OffloadManager`` of each group, by group name.
    """

    def __init__(self, layout: DeepSeekV4Layout, managers: Mapping[str, OffloadManager]) -> None:
        """Check that each manager manages its group's tensors.

        Raises:
            GeometryError: the groups and managers differ, one manager serves several groups,
                or a manager's pages do not match its group's tensors.
        """
        names = [g.name for g in layout.groups]
        if sorted(managers) != sorted(names):
            raise GeometryError(f"managers: expected one per group {names}, got {sorted(managers)}")
        if len(set(map(id, managers.values()))) < len(managers):  # room is checked per group
            raise GeometryError("managers: expected one manager per group, got one for several")
        for group in layout.groups:
            got = [int(b) for b in managers[group.name].gpu_layout.page_bytes]
            want = [t.page_bytes for t in group.tensors]
            if got != want:
                raise GeometryError(f"managers[{group.name!r}]: expected pages {want} B, got {got}")
        self.layout = layout
        self.managers = dict(managers)
        self._stack: contextlib.AsyncExitStack | None = None

    @classmethod
    def create(
        cls,
        layout: DeepSeekV4Layout,
        caches: Mapping[str, Sequence[torch.Tensor]],
        num_cpu_blocks: Mapping[str, int],
        *,
        engine: str = "auto",
        hooks: Mapping[str, Sequence[StepHook]] | None = None,
        **config: Any,
    ) -> DeepSeekV4Offload:
        """Managers over ``caches`` (as :func:`allocate_caches` returns), not entered yet.

        Args:
            layout: the model's cache layout.
            caches: each group's tensors, in the layout's order.
            num_cpu_blocks: CPU-tier blocks of each group.
            engine: ``ManagerConfig.engine`` of every manager.
            hooks: step hooks by group name (a group's manager runs them in ``step``).
            config: further ``ManagerConfig`` fields, for every manager.

        Raises:
            ConfigError, GeometryError, HostMemoryError: as ``OffloadManager``.
        """
        managers = {}
        for group in layout.groups:
            cfg = ManagerConfig(num_cpu_blocks=num_cpu_blocks[group.name], engine=engine,
                                manage_gpu_blocks=False, **config)  # fmt: skip
            managers[group.name] = OffloadManager(
                caches[group.name], cfg, hooks=(hooks or {}).get(group.name, ())
            )
        return cls(layout, managers)

    async def __aenter__(self) -> DeepSeekV4Offload:
        stack = contextlib.AsyncExitStack()
        for manager in self.managers.values():
            await stack.enter_async_context(manager)
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._stack is not None:
            await self._stack.aclose()

    def keys(self, num_tokens: int, block_keys: Sequence[bytes], boundary_key: bytes) -> dict[str, list[bytes]]:  # fmt: skip
        """:func:`boundary_keys` of this layout."""
        return boundary_keys(self.layout, num_tokens, block_keys, boundary_key)

    def store(
        self,
        num_tokens: int,
        block_tables: Mapping[str, Sequence[int]],
        block_keys: Sequence[bytes],
        boundary_key: bytes,
    ) -> asyncio.Future[list[Any]]:
        """Queue the store of every group's live blocks at ``num_tokens``.

        Args:
            num_tokens: the boundary ``N``.
            block_tables: each group's block table of the request (logical block -> GPU block
                id; entries of dropped blocks may be negative, live ones may not).
            block_keys, boundary_key: as :func:`boundary_keys`.

        Returns:
            A future of the per-group ``SwapResult`` list (flushed by the next :meth:`step`);
            a group refusing after others queued fails it once their copies ended.

        Raises:
            InvalidBlockError, PoolExhaustedError: a live block is missing from a table, a
                group's ids are bad, or a group lacks room (checked in every group first).
            KVMgrError: as ``OffloadManager.swap_out``.
        """
        keys = self.keys(num_tokens, block_keys, boundary_key)
        ids = {name: self._live_ids(name, num_tokens, block_tables) for name in keys}
        check_stores(self.managers, ids, keys)  # every group's ids and room, before any queues
        return queue_all(partial(self.managers[n].swap_out, ids[n], k) for n, k in keys.items() if k)  # fmt: skip

    def is_restorable(self, num_tokens: int, block_keys: Sequence[bytes], boundary_key: bytes) -> bool:  # fmt: skip
        """Whether every group holds all its blocks of this restore point READY (touches them)."""
        keys = self.keys(num_tokens, block_keys, boundary_key)
        return all(self.managers[n].lookup(k) == len(k) for n, k in keys.items())

    def load(
        self,
        num_tokens: int,
        gpu_block_ids: Mapping[str, Sequence[int]],
        block_keys: Sequence[bytes],
        boundary_key: bytes,
    ) -> asyncio.Future[list[Any]]:
        """Queue the load of a restore point into fresh GPU blocks.

        Args:
            num_tokens: the boundary ``N``.
            gpu_block_ids: per group, one GPU block id per block of
                ``layout.blocks_at(group, N)`` (in that order).
            block_keys, boundary_key: as :func:`boundary_keys`.

        Returns:
            A future of the per-group ``SwapResult`` list (flushed by the next :meth:`step`);
            a group refusing after others queued fails it once their copies ended.

        Raises:
            InvalidBlockError: wrong number of ids, or bad ids, for a group (nothing queued).
            UnknownKeyError: some group does not hold the restore point READY (nothing queued).
            KVMgrError: as ``OffloadManager.swap_in``.
        """
        keys = self.keys(num_tokens, block_keys, boundary_key)
        for name, k in keys.items():
            if len(gpu_block_ids.get(name, ())) != len(k):
                got = len(gpu_block_ids.get(name, ()))
                raise InvalidBlockError(
                    f"gpu_block_ids[{name!r}]: expected {len(k)} ids, got {got}"
                )
            self.managers[name].check_gpu_blocks(gpu_block_ids.get(name, ()), "load")
            if self.managers[name].peek(k) != len(k):
                raise UnknownKeyError(
                    f"group {name!r}: the restore point at {num_tokens} is not READY"
                )
        ids = {name: list(gpu_block_ids[name]) for name in keys}
        return queue_all(partial(self.managers[n].swap_in, k, ids[n]) for n, k in keys.items() if k)  # fmt: skip

    async def step(self, ctx: StepContext | None = None) -> list[StepReport]:
        """``step(ctx)`` of every manager (hooks run where registered; one flush per group)."""
        return [await manager.step(ctx) for manager in self.managers.values()]

    def _live_ids(self, name: str, num_tokens: int, tables: Mapping[str, Sequence[int]]) -> list[int]:  # fmt: skip
        """The live entries as they are (``check_gpu_blocks`` refuses floats and bools; ``int``
        would truncate 2.5 to block 2 and store another block's KV)."""
        table = tables.get(name, ())
        blocks = self.layout.blocks_at(name, num_tokens)
        live = [table[i] for i in blocks] if len(table) >= blocks.stop else [None]
        if len(blocks) and any(b is None or (isinstance(b, (int, float)) and b < 0) for b in live):
            raise InvalidBlockError(
                f"block_tables[{name!r}]: expected GPU blocks for logical blocks "
                f"{blocks.start}..{blocks.stop - 1}, got {list(table)[blocks.start : blocks.stop]}"
            )
        return live
