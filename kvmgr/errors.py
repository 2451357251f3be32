"""The kvmgr exception hierarchy: one small class per failure mode, all under ``KVMgrError``.

Every error raised for bad input is raised before any state changes, so catching it leaves the
manager exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "BlockStateError",
    "ClosedBeforeCopyError",
    "ClosedError",
    "ConfigError",
    "DoubleFreeError",
    "EventLoopError",
    "GeometryError",
    "HazardError",
    "HostMemoryError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "InvalidKeyError",
    "KVMgrError",
    "LayerLoadError",
    "LayerOrderError",
    "LayerStoreError",
    "LayerwiseError",
    "LayoutMismatchError",
    "PoolExhaustedError",
    "RankError",
    "RankTimeoutError",
    "StaleKVTensorError",
    "TierError",
    "TierFullError",
    "TierSecurityWarning",
    "TierTimeoutError",
    "TierUnavailableError",
    "TransferError",
    "TransferTimeoutError",
    "UnknownKeyError",
    "UnknownRequestError",
]


class KVMgrError(Exception):
    """Base class of every error kvmgr raises on purpose."""


class ConfigError(KVMgrError, ValueError):
    """A configuration value or combination of values is invalid."""


class GeometryError(KVMgrError, ValueError):
    """KV tensors have shapes, dtypes, devices or layouts kvmgr cannot manage."""


class InvalidArgumentError(KVMgrError, ValueError):
    """An argument has the wrong type or value (a count, a request id, a step context)."""


class InvalidBlockError(KVMgrError, ValueError):
    """A block id is out of range, duplicated, or does not belong to this pool."""


class DoubleFreeError(InvalidBlockError):
    """A block id was freed while it was already free."""


class InvalidKeyError(KVMgrError, ValueError):
    """A key is not ``bytes``, or keys repeat where they must be distinct, or counts differ."""


class UnknownKeyError(KVMgrError, KeyError):
    """A key is not in the prefix index."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown key"


class BlockStateError(KVMgrError, RuntimeError):
    """A block is in the wrong state for the operation (for example a PENDING key swapped in)."""


class UnknownRequestError(KVMgrError, KeyError):
    """A request id has no block table."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown request"


class PoolExhaustedError(KVMgrError, RuntimeError):
    """Not enough free or evictable blocks; nothing was changed.

    Attributes:
        needed: blocks the operation asked for.
        available: blocks that were free or evictable at the time.
        reason: short machine-readable reason (``"cpu_full"``, ``"gpu_full"``, ...).
    """

    def __init__(self, message: str, *, needed: int, available: int, reason: str) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available
        self.reason = reason

    def reworded(self, message: str) -> PoolExhaustedError:
        """The same refusal (``needed``, ``available``, ``reason``) with another message: for
        a caller naming where it happened (a cache group)."""
        return PoolExhaustedError(
            message, needed=self.needed, available=self.available, reason=self.reason
        )


class HazardError(KVMgrError, RuntimeError):
    """A transfer batch would read and write one block, or write one destination twice."""


class TransferError(KVMgrError, RuntimeError):
    """A copy failed; the blocks it was filling are not readable.

    Attributes:
        fail_index: index of the failing descriptor when the driver reports it, else ``None``.
    """

    def __init__(self, message: str, *, fail_index: int | None = None) -> None:
        super().__init__(message)
        self.fail_index = fail_index


class TransferTimeoutError(TransferError):
    """An await passed its deadline; the copy itself may still be running and stays fenced.

    Deliberately not a builtin ``TimeoutError``: ``asyncio.wait_for`` around kvmgr calls raises
    that one, and the two must not be confused.
    """


class StaleKVTensorError(TransferError):
    """A KV tensor's storage moved or changed size after the manager was built (``resize_``,
    ``set_``): copies would use freed memory, so the batch is failed instead."""


class RankError(TransferError):
    """A rank of a tensor-parallel group failed a job, died, or could not be reached; the job
    failed on every rank and its blocks never became READY.

    Attributes:
        rank: the rank that caused it.
    """

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class RankTimeoutError(RankError):
    """A rank did not report a job within the group's deadline; it is presumed dead and the
    manager stops offloading (new swaps fail with ``RankError``)."""


class LayoutMismatchError(GeometryError):
    """The ranks of a group disagree about the KV layout (blocks, page bytes, layout kind).

    Attributes:
        rank: the first rank that differs from rank 0.
    """

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class HostMemoryError(KVMgrError, MemoryError):
    """The CPU tier's host memory could not be allocated or registered.

    Attributes:
        num_bytes: bytes asked for.
    """

    def __init__(self, message: str, *, num_bytes: int) -> None:
        super().__init__(message)
        self.num_bytes = num_bytes


class EventLoopError(KVMgrError, RuntimeError):
    """A call that queues work ran outside a running asyncio event loop, or on another loop
    while the manager had work queued or in flight on its own."""


class ClosedError(KVMgrError, RuntimeError):
    """The manager or engine is closed, or closed while the operation was pending."""


class LayerOrderError(InvalidArgumentError):
    """A layerwise load or store was used out of its contract: a layer it does not cover, a
    layer waited for after a later one, a layer saved twice or out of order, or a call inside
    a CUDA graph capture (``kvmgr.transfer.layerwise``)."""


class LayerwiseError(TransferError):
    """A layerwise load or store failed as a whole (a group was refused, failed on the device,
    or was never submitted): the base of ``LayerLoadError`` and ``LayerStoreError``; catch it
    for either."""


class LayerLoadError(LayerwiseError):
    """A layer of a layerwise load failed (or an earlier one did): the load is failed as a
    whole and no layer of it may be read; recompute instead."""


class LayerStoreError(LayerLoadError):
    """A layer group of a layerwise store was refused or failed, or the store was aborted
    before every layer was saved: the store is failed as a whole and its keys are dropped
    (never READY); the forward's KV in the GPU blocks is untouched.

    A subclass of ``LayerLoadError`` only for backward compatibility (stores raised that before
    round 4, session 14): an ``except LayerLoadError`` around a store still catches it. Catch
    ``LayerStoreError`` for a store, ``LayerwiseError`` for either.
    """


class ClosedBeforeCopyError(ClosedError, TransferError):
    """The engine closed before this batch's copy started: nothing was copied."""


class TierError(KVMgrError, RuntimeError):
    """A lower tier (disk, shared store) failed an operation; what it was filling is not readable.

    A tier error never changes the CPU tier: callers treat it as a miss and recompute.
    """


class TierTimeoutError(TierError):
    """A tier operation passed its deadline; a write may still land later, a read returns nothing.

    Deliberately not a subclass of the builtin ``TimeoutError``, so ``except TimeoutError`` around
    asyncio code never swallows it by accident.
    """


class TierUnavailableError(TierError):
    """The tier cannot be reached (server down, connection refused or reset, authentication)."""


class TierFullError(TierError):
    """The tier refused a write for lack of space (``maxmemory`` with ``noeviction``, disk full)."""


class TierSecurityWarning(UserWarning):
    """A shared tier is set up so that tenants sharing the server are not isolated (the server's
    ``default`` user, or a namespace without a tenant salt); see docs/tiers.md."""
