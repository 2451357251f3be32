"""The second half of a simulated step: what the computed tokens change.

``Scheduler.execute`` (``kvmgr.sim.scheduler``) runs ``execute_step``: prefill chunks write
their pages, newly full prefix blocks are published and (write-through) stored, decodes
advance, finished requests release their blocks, and under write-on-evict cached blocks drain
to the CPU tier until the free list reaches the watermark (plus what admission lacked).
"""

from __future__ import annotations

from typing import Any, Protocol

from kvmgr.sim.counters import SimCounters
from kvmgr.sim.gpu_cache import GPUPrefixCache
from kvmgr.sim.pages import PageStore
from kvmgr.sim.request import SimRequest
from kvmgr.sim.swaps import SwapIssuer


class SchedulerState(Protocol):
    """What a step's execution uses of ``kvmgr.sim.scheduler.Scheduler`` (which imports this
    module: the protocol keeps the import one-way)."""

    config: Any  #: ``SchedulerConfig``: block_size, watermark_blocks
    counters: SimCounters
    gpu: GPUPrefixCache
    pages: PageStore
    swaps: SwapIssuer
    running: list[SimRequest]
    shortfall: int


class PlannedStep(Protocol):
    """What one step computes (``kvmgr.sim.scheduler.StepPlan``)."""

    decodes: list[SimRequest]
    prefills: list[tuple[SimRequest, int]]


__all__ = ["PlannedStep", "SchedulerState", "execute_step"]


def execute_step(sched: SchedulerState, plan: PlannedStep, end_s: float) -> None:
    """``sched.execute``: compute the plan's tokens (virtually), publish and store full prefix
    blocks, finish requests, and drain cached blocks under write-on-evict; ``end_s`` is the
    step's end."""
    stores: tuple[list[int], list[bytes]] = ([], [])
    for request, chunk in plan.prefills:
        _run_prefill(sched, request, chunk, stores, end_s)
    for request in plan.decodes:
        request.num_computed += 1
        request.num_decoded += 1
        if request.ttft_s is None:  # the whole prompt was a hit: nothing was prefilled
            request.ttft_s = end_s - request.trace.arrival_s
        if request.num_decoded >= request.trace.output_length:
            _finish(sched, request)
    sched.counters.decode_tokens += len(plan.decodes)
    if stores[0]:
        sched.swaps.store(*stores)
    if not sched.gpu.evict_clean:
        want = sched.config.watermark_blocks + sched.shortfall - sched.gpu.num_free
        if want > 0:
            sched.swaps.store(*sched.gpu.start_drain(want), drain=True)


def _run_prefill(
    sched: SchedulerState,
    request: SimRequest,
    chunk: int,
    stores: tuple[list[int], list[bytes]],
    end_s: float,
) -> None:
    """Compute ``chunk`` prompt tokens: write their full blocks' pages, mark them ready and
    collect the published ones to store (write-through)."""
    assert request.keys is not None
    bs, keys = sched.config.block_size, request.keys
    before, request.num_computed = request.num_computed, request.num_computed + chunk
    sched.counters.prefill_tokens += chunk
    if request.num_admissions > 1:
        sched.counters.recompute_tokens += chunk
    first, last = before // bs, min(request.num_computed // bs, len(keys))
    if last > first:
        ids = request.block_ids[first:last]
        sched.pages.write(ids, keys[first:last])
        ready = [i for i, b in enumerate(ids, start=first) if sched.gpu.is_published(b)]
        sched.gpu.mark_ready([request.block_ids[i] for i in ready])
        if sched.gpu.evict_clean:
            stores[0].extend(request.block_ids[i] for i in ready)
            stores[1].extend(keys[i] for i in ready)
    request.maybe_jump(bs)
    if request.num_computed >= request.target and request.ttft_s is None:
        request.ttft_s = end_s - request.trace.arrival_s


def _finish(sched: SchedulerState, request: SimRequest) -> None:
    """A request generated its last token: its blocks go back, its TTFT is counted."""
    sched.gpu.release(list(reversed(request.block_ids)))
    request.block_ids = []
    sched.running.remove(request)
    sched.counters.requests_done += 1
    if request.ttft_s is not None:
        sched.counters.ttft_s.append(request.ttft_s)
