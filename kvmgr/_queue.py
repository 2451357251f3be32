"""Swap queue of the manager: queued operations, ordered generations, submitted batches.

Private. Everything queued since the last flush is kept in *generations*: one plan per direction
per generation. A new operation joins the newest generation unless it touches a GPU block that
the generation already touches the other way (a load into a block a store still reads, or a
store of a block a load still writes); then it opens a new generation, submitted after the
previous one (docs/transfer.md, rule 5). Batches already submitted are fenced the same way:
a batch waits for every in-flight batch of the other direction that shares a GPU block.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from kvmgr.reports import DirectionReport
from kvmgr.transfer.engine import BatchHandle
from kvmgr.transfer.plan import Direction, TransferPlan

__all__: list[str] = []


@attrs.define(eq=False)
class Op:
    """One queued swap: block pairs, its asyncio future, and its bookkeeping callbacks.

    ``on_success()`` runs when the copy completed and returns the future's result;
    ``on_failure(exc)`` rolls the bookkeeping back. Both run on the event-loop thread, once.
    """

    direction: Direction
    src_ids: list[int]
    dst_ids: list[int]
    future: asyncio.Future[Any]
    on_success: Callable[[], Any]
    on_failure: Callable[[BaseException], None]

    @property
    def gpu_ids(self) -> list[int]:
        return self.src_ids if self.direction is Direction.D2H else self.dst_ids


@attrs.define(eq=False)
class Lane:
    """One direction of a generation: its ops and their block pairs, flattened in order."""

    ops: list[Op] = attrs.field(factory=list)
    src_ids: list[int] = attrs.field(factory=list)
    dst_ids: list[int] = attrs.field(factory=list)


@attrs.define(eq=False)
class Generation:
    """Operations that can share one plan per direction."""

    lanes: dict[Direction, Lane] = attrs.field(
        factory=lambda: {Direction.D2H: Lane(), Direction.H2D: Lane()}
    )
    gpu_read: set[int] = attrs.field(factory=set)
    gpu_written: set[int] = attrs.field(factory=set)

    def conflicts(self, op: Op) -> bool:
        if op.direction is Direction.D2H:  # a store reads: only earlier writes conflict
            return bool(self.gpu_written) and not self.gpu_written.isdisjoint(op.gpu_ids)
        if not (self.gpu_read or self.gpu_written):
            return False
        return not (
            self.gpu_read.isdisjoint(op.gpu_ids) and self.gpu_written.isdisjoint(op.gpu_ids)
        )

    def add(self, op: Op) -> None:
        lane = self.lanes[op.direction]
        lane.ops.append(op)
        lane.src_ids.extend(op.src_ids)
        lane.dst_ids.extend(op.dst_ids)
        target = self.gpu_read if op.direction is Direction.D2H else self.gpu_written
        target.update(op.gpu_ids)


@attrs.define(eq=False)
class Batch:
    """One submitted plan and the operations it completes."""

    direction: Direction
    ops: list[Op]
    gpu_ids: np.ndarray
    handle: BatchHandle | None = None


class SwapQueue:
    """Generations of queued operations plus the batches in flight."""

    def __init__(self) -> None:
        self.generations: list[Generation] = [Generation()]
        self.in_flight: list[Batch] = []

    def __len__(self) -> int:
        return sum(len(lane.ops) for g in self.generations for lane in g.lanes.values())

    def add(self, op: Op) -> None:
        newest = self.generations[-1]
        if newest.conflicts(op):
            newest = Generation()
            self.generations.append(newest)
        newest.add(op)

    def take(self) -> list[Generation]:
        """Remove and return every queued generation."""
        taken, self.generations = self.generations, [Generation()]
        return taken

    def fences(self, batch: Batch) -> list[BatchHandle]:
        """In-flight batches of the other direction that share a GPU block with ``batch``."""
        return [
            other.handle
            for other in self.in_flight
            if other.direction is not batch.direction
            and other.handle is not None
            and np.isin(batch.gpu_ids, other.gpu_ids).any()
        ]


def direction_report(num_ops: int, plan: TransferPlan) -> DirectionReport:
    """Counts of one direction's plan for the step report."""
    return DirectionReport(
        swaps=num_ops,
        blocks=plan.num_blocks,
        pages=plan.num_pages,
        descriptors=plan.num_descriptors,
        bytes=plan.num_bytes,
        batches=1,
    )


def add_reports(a: DirectionReport, b: DirectionReport) -> DirectionReport:
    """Field-wise sum."""
    return DirectionReport(
        **{f.name: getattr(a, f.name) + getattr(b, f.name) for f in attrs.fields(DirectionReport)}
    )
