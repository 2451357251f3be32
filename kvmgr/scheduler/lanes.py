"""Parts and lanes: one swap call's record, and one direction's parts with their ids.

Private to ``kvmgr.scheduler``; ``queue`` groups lanes into generations (and re-exports these).
"""

from __future__ import annotations

import array
import asyncio
import enum
from collections.abc import Hashable
from typing import Any

import attrs
import numpy as np

from kvmgr.scheduler.jobs import Direction

__all__ = ["Kind", "Lane", "Part"]


class Kind(enum.IntEnum):
    """What a part does; the direction follows from it."""

    STORE = 0  #: keyed GPU -> CPU
    LOAD = 1  #: keyed CPU -> GPU
    PREEMPT = 2  #: a request's blocks GPU -> CPU
    RESUME = 3  #: a request's blocks CPU -> GPU


@attrs.define(eq=False)  # slots; compared by identity
class Part:
    """One swap call's share of a lane.

    Attributes:
        kind: what it does.
        future: resolved with ``result`` once the copy and its bookkeeping completed.
        result: the value the future gets on success (built when the part was prepared).
        gpu_ids / cpu_ids: its block ids (list or int64 array), GPU read/written and CPU
            written/read, aligned.
        keys: keyed parts: the keys copied, aligned with the ids; else ``None``.
        req_id: request-level parts: the request; else ``None``.
        parents: keyed stores: ``parents[i]`` is the key ``keys[i]`` extends (``None``: a root),
            for the ``stored`` event; ``None`` for the default chain (``keys[i]`` extends
            ``keys[i - 1]``, ``keys[0]`` a root: no list kept per queued call) and for others.
        token_ids: keyed stores given token ids: int32 ``[len(keys), block_size]`` (the
            caller's copy, rows of the keys stored); else ``None``.
    """

    kind: Kind
    future: asyncio.Future[Any]
    result: object
    gpu_ids: Any
    cpu_ids: Any
    keys: list[bytes] | None = None
    req_id: Hashable | None = None
    parents: list[bytes | None] | None = attrs.field(default=None, kw_only=True)
    token_ids: np.ndarray | None = attrs.field(default=None, kw_only=True)

    @property
    def direction(self) -> Direction:
        """D2H for stores and preempts, H2D for loads and resumes."""
        return Direction.D2H if self.kind in (Kind.STORE, Kind.PREEMPT) else Direction.H2D


class Lane:
    """One direction of a generation: its parts and their block ids, accumulated cheaply.

    Ids accumulate in part order in int64 ``array.array`` buffers (a small part's list is
    appended in C, a large part's array copied in), so ``arrays()`` is two zero-copy views. A
    D2H lane also accumulates its keyed stores' keys, and request-level parts (preempts,
    resumes) are listed apart, so completion never walks every part.

    Attributes:
        parts: every part, in the order added.
        num_calls: the swap calls its parts stand for (a part of recorded per-call stores
            stands for many).
        stores: D2H lanes: the keyed stores, in part order; H2D lanes: empty.
        num_token_parts: keyed stores of the lane that carry token ids.
        requests: the request-level parts (preempts, resumes), in part order.
    """

    __slots__ = (
        "_cpu", "_gpu", "_keys", "direction", "num_calls", "num_token_parts", "parts",
        "requests", "stores",
    )  # fmt: skip

    def __init__(self, direction: Direction) -> None:
        self.direction = direction
        self.parts: list[Part] = []
        self.stores: list[Part] = []
        self._keys: list[bytes] | None = None
        self.num_token_parts = 0
        self.num_calls = 0
        self.requests: list[Part] = []
        self._gpu = array.array("q")
        self._cpu = array.array("q")

    def add(self, part: Part, num_calls: int = 1) -> None:
        """Append a part standing for ``num_calls`` swap calls (not after ``arrays()``: its
        views pin the buffers' size)."""
        self.parts.append(part)
        self.num_calls += num_calls
        gpu, cpu = part.gpu_ids, part.cpu_ids
        if type(gpu) is list:
            self._gpu.fromlist(gpu)
        else:
            self._gpu.frombytes(_raw(gpu))
        if type(cpu) is list:
            self._cpu.fromlist(cpu)
        else:
            self._cpu.frombytes(_raw(cpu))
        if part.keys is None:
            self.requests.append(part)
        elif self.direction is Direction.D2H:
            self.stores.append(part)
            self._keys = None
            if part.token_ids is not None:
                self.num_token_parts += 1

    @property
    def keys(self) -> list[bytes]:
        """D2H lanes: the keys of the keyed stores, in part order (aligned with the ids when
        ``requests`` is empty; one store's own list, not a copy: read it); H2D lanes: empty."""
        stores = self.stores
        if len(stores) == 1:
            return stores[0].keys  # type: ignore[return-value]
        if self._keys is None:
            keys: list[bytes] = []
            for part in stores:
                keys += part.keys  # type: ignore[arg-type]
            self._keys = keys
        return self._keys

    @property
    def parents(self) -> tuple[bytes | None, ...]:
        """D2H lanes: one parent per entry of ``keys`` (``None``: a root), built when asked."""
        out: list[bytes | None] = []
        for part in self.stores:
            keys: list[bytes] = part.keys  # type: ignore[assignment]
            if part.parents is not None:
                out += part.parents
            elif keys:  # the default chain
                if len(self.stores) == 1:
                    return (None, *keys[:-1])
                out.append(None)
                out += keys[:-1]
        return tuple(out)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(GPU ids, CPU ids) of every part, int64, aligned, in part order (views of the
        lane's buffers: read them, do not write)."""
        return np.frombuffer(self._gpu, dtype=np.int64), np.frombuffer(self._cpu, dtype=np.int64)


def _raw(ids: Any) -> np.ndarray:
    """The bytes of an int64 id array, for ``array.frombytes`` (no copy when already int64)."""
    return np.ascontiguousarray(ids, dtype=np.int64).view(np.uint8)
