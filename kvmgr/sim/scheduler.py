"""The simulated scheduler: continuous batching over a GPU prefix cache and kvmgr's CPU tier.

Offers:
    SchedulerConfig   block size, token budget, batch size, write policy, watermark
    StepPlan          what one step computes: decodes and prefill chunks
    Scheduler         admission, preemption, prefill/decode accounting and every manager call

One step, as ``loop.py`` drives it:

1. ``schedule()``: running requests that decode get one token each (a new GPU block at each
   block boundary; when none is left, the most recently admitted request is preempted: its
   prefix blocks stay in the GPU cache, its private tail goes to the CPU tier through
   ``manager.preempt``). Then prefill chunks within the token budget, then admissions in
   arrival order: GPU prefix cache first, ``manager.lookup`` for the rest, ``swap_in`` of the
   CPU hits, ``resume`` of a preempted tail, new blocks for the misses.
2. ``execute()``: the step's tokens are computed: newly full prefix blocks get their page
   fingerprints and are published; write-through stores them with ``swap_out``; finished
   requests release their blocks; under write-on-evict, cached blocks are drained to the CPU
   tier until the free list reaches the watermark (plus what admission lacked).
3. the loop calls ``manager.step()`` once, then ``swaps.settle()``: every swap queued this
   step is awaited (so results never depend on thread timing), loads are verified page by page.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

from kvmgr.errors import PoolExhaustedError
from kvmgr.sim.counters import SimCounters
from kvmgr.sim.execute import execute_step
from kvmgr.sim.gpu_cache import GPUPrefixCache
from kvmgr.sim.keys import BlockKeyer
from kvmgr.sim.pages import PageStore
from kvmgr.sim.request import SimRequest
from kvmgr.sim.swaps import SwapIssuer

__all__ = ["WRITE_POLICIES", "Scheduler", "SchedulerConfig", "StepPlan"]

#: "through": store each prefix block when it is filled; "evict": when the GPU cache evicts it.
WRITE_POLICIES = ("through", "evict")


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Scheduler settings (validated by ``SimConfig``).

    Attributes:
        block_size: tokens per block.
        max_batched_tokens: token budget of one step (decodes count one each).
        max_seqs: most requests running at once.
        write_policy: ``"through"`` or ``"evict"``.
        watermark_blocks: GPU blocks kept available when admitting next to running requests.
    """

    block_size: int
    max_batched_tokens: int
    max_seqs: int
    write_policy: str
    watermark_blocks: int


@attrs.define(eq=False)
class StepPlan:
    """What one step computes."""

    decodes: list[SimRequest] = attrs.field(factory=list)
    prefills: list[tuple[SimRequest, int]] = attrs.field(factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed: one per decode plus the prefill chunks."""
        return len(self.decodes) + sum(n for _, n in self.prefills)


class Scheduler:
    """Continuous batching with prefix caching on two tiers; see the module docstring.

    Args:
        config: scheduler settings.
        manager: an open ``OffloadManager`` over ``pages.tensors`` with caller-owned GPU blocks.
        pages: the GPU tensors and their fingerprints.
        counters: totals to update.
        on_admit: called with a request's trace index each time it is admitted (the
            offline optimum consumes the trace's future through it).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        manager: Any,
        pages: PageStore,
        counters: SimCounters,
        *,
        on_admit: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.pages = pages
        self.counters = counters
        self.gpu = GPUPrefixCache(
            pages.tensors[0].shape[0], evict_clean=config.write_policy == "through"
        )
        self.swaps = SwapIssuer(manager, pages, self.gpu, counters, config.block_size)
        self.keyer = BlockKeyer(config.block_size)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.shortfall = 0  #: blocks admission lacked this step (write-on-evict drains them)
        self._on_admit = on_admit

    @property
    def is_idle(self) -> bool:
        """No request waiting or running."""
        return not self.waiting and not self.running

    def add(self, request: SimRequest) -> None:
        """A request arrives (or is rejected when it could never fit in the GPU blocks)."""
        self.counters.requests_arrived += 1
        size = request.trace.input_length + request.trace.output_length
        if -(-size // self.config.block_size) > self.gpu.num_blocks:
            self.counters.requests_rejected += 1
            return
        self.waiting.append(request)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> StepPlan:
        """Choose this step's decodes, prefill chunks and admissions; queue their swaps."""
        self.shortfall = 0
        plan = StepPlan()
        prefilling: list[SimRequest] = []
        num_preempted = self._schedule_decodes(plan, prefilling)
        budget = self.config.max_batched_tokens - len(plan.decodes)
        for request in prefilling:
            if budget <= 0:
                break
            budget = self._add_prefill(plan, request, budget)
        if num_preempted == 0:
            self._admit(plan, budget)
        return plan

    def _schedule_decodes(self, plan: StepPlan, prefilling: list[SimRequest]) -> int:
        """One token for each decoding request, in admission order; preempts from the back
        when a request needs a new block and none can be reclaimed. Requests still prefilling
        are appended to ``prefilling``. Returns the number of preemptions."""
        bs, running, decodes = self.config.block_size, self.running, plan.decodes
        num_preempted = 0
        i = 0
        while i < len(running):
            request = running[i]
            i += 1
            if request.num_loads:
                continue
            if request.num_computed < request.trace.input_length + request.num_decoded:
                prefilling.append(request)
                continue
            if request.num_computed >= len(request.block_ids) * bs:
                while self._reclaimable() < 1:
                    victim = running[-1]
                    self._preempt(victim)
                    num_preempted += 1
                    if victim is request:
                        return num_preempted  # everything after it is preempted too
                ids = self.gpu.allocate(1)
                if ids is None:  # write-on-evict: cached blocks must drain first
                    self.shortfall += 1
                    continue
                self._write_private(request, ids, len(request.block_ids))
                request.block_ids.extend(ids)
            decodes.append(request)
        return num_preempted

    def _reclaimable(self) -> int:
        if self.gpu.evict_clean:
            return self.gpu.num_available()
        return self.gpu.num_free + self.gpu.num_cached + self.swaps.num_draining

    def _add_prefill(self, plan: StepPlan, request: SimRequest, budget: int) -> int:
        if request.num_loads or request.num_computed >= request.target:
            return budget
        chunk = min(request.prefill_end(self.config.block_size) - request.num_computed, budget)
        if chunk > 0:
            plan.prefills.append((request, chunk))
        return budget - chunk

    def _admit(self, plan: StepPlan, budget: int) -> None:
        deferred: list[SimRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_seqs:
            request = self.waiting.popleft()
            outcome = self._try_admit(request)
            if outcome == "deferred":
                deferred.append(request)
                continue
            if outcome == "no_room":
                self.waiting.appendleft(request)
                break
            self.running.append(request)
            if budget > 0:
                budget = self._add_prefill(plan, request, budget)
        self.waiting.extendleft(reversed(deferred))

    def _try_admit(self, request: SimRequest) -> str:
        bs, gpu = self.config.block_size, self.gpu
        if request.keys is None:
            request.keys = self.keyer.prefix_keys(request.trace)
            self.swaps.learn_chain(request.keys)
        keys = request.keys
        num_gpu_hits, is_blocked = gpu.match(keys)
        if is_blocked:
            return "deferred"  # another request is computing or loading the next block
        need = -(-request.target // bs) - num_gpu_hits
        hit_ids = [gpu.block_of(key) for key in keys[:num_gpu_hits]]
        room = gpu.num_available() - (self.config.watermark_blocks if self.running else 0)
        if gpu.evict_clean:
            room -= gpu.num_unreferenced(hit_ids)  # acquiring them takes them off the LRU
        if need > room:
            self.shortfall += need
            return "no_room"
        self._place(request, num_gpu_hits, hit_ids, need)
        return "admitted"

    def _place(self, request: SimRequest, num_gpu_hits: int, hit_ids: list[int], need: int) -> None:
        """Admit a request that fits: GPU hits acquired, CPU hits loaded, a preempted tail
        resumed, new blocks for the rest (their private pages written), counted."""
        bs, gpu = self.config.block_size, self.gpu
        keys = request.keys
        assert keys is not None
        num_cpu_hits = self.swaps.lookup(keys[num_gpu_hits:])
        self.swaps.claim(keys[num_gpu_hits + num_cpu_hits :], request.index)
        gpu.acquire(hit_ids)
        new_ids = gpu.allocate(need)
        assert new_ids is not None
        request.block_ids = hit_ids + new_ids
        for i in range(num_gpu_hits, len(keys)):
            gpu.publish(request.block_ids[i], keys[i], is_ready=False)
        hits = num_gpu_hits + num_cpu_hits
        if num_cpu_hits:
            self.swaps.load(request, keys[num_gpu_hits:hits], request.block_ids[num_gpu_hits:hits])
        request.num_computed = hits * bs
        first_private = len(keys)
        if request.tail_tokens is not None:
            first_private = -(-request.tail_tokens // bs)
            self.swaps.resume(request, len(keys), first_private)
        self._write_private(request, request.block_ids[first_private:], first_private)
        request.num_admissions += 1
        if self._on_admit is not None:
            self._on_admit(request.index)
        self.counters.count_admission(
            is_first=request.num_admissions == 1,
            prompt_tokens=request.trace.input_length,
            num_keys=len(keys),
            gpu_hits=num_gpu_hits,
            cpu_hits=num_cpu_hits,
            block_size=bs,
        )

    def _write_private(self, request: SimRequest, block_ids: list[int], first: int) -> None:
        self.pages.write(block_ids, request.private_keys(first, len(block_ids)))

    def _preempt(self, victim: SimRequest) -> None:
        """Swap the victim's private tail out, release its prefix blocks, requeue it first."""
        assert victim.keys is not None
        bs, num_prefix = self.config.block_size, len(victim.keys)
        valid = victim.valid_tokens()
        tail_end = max(num_prefix, -(-valid // bs))
        tail_ids = victim.block_ids[num_prefix:tail_end]
        self.gpu.release(
            list(reversed(victim.block_ids[:num_prefix] + victim.block_ids[tail_end:]))
        )
        self.running.remove(victim)
        victim.tail_tokens = None
        if tail_ids:
            try:
                self.swaps.preempt(victim, tail_ids, valid)
            except PoolExhaustedError:  # no CPU room: recompute the tail on re-admission
                self.gpu.release(tail_ids)
                self.counters.preempt_recomputes += 1
        victim.block_ids, victim.num_computed, victim.jump_to = [], 0, None
        self.counters.preemptions += 1
        self.waiting.appendleft(victim)

    # ------------------------------------------------------------------ execute

    def execute(self, plan: StepPlan, end_s: float) -> None:
        """Compute the plan's tokens (virtually), publish and store full prefix blocks, finish
        requests, and drain cached blocks under write-on-evict; ``end_s`` is the step's end
        (``kvmgr.sim.execute``)."""
        execute_step(self, plan, end_s)
