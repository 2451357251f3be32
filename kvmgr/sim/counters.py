"""Running counters of one simulation (mutable; the report is built from them at the end).

Offers:
    SimCounters     every total the scheduler and the loop update while the simulation runs
"""

from __future__ import annotations

import attrs

from kvmgr.reports import DirectionReport

__all__ = ["SimCounters"]


@attrs.define(kw_only=True)
class SimCounters:
    """Totals of one run; every counter only grows.

    Prefix accounting counts each request once, at its first admission (re-admissions after a
    preemption are counted under ``resume_*`` and ``recompute_tokens``), so that with unbounded
    capacities the hit ratio equals the trace's reuse ceiling.

    Attributes:
        requests_arrived / requests_done / requests_rejected: requests that arrived, finished,
            or were dropped because they need more GPU blocks than exist.
        prompt_tokens: prompt tokens of admitted requests.
        lookup_blocks: published (full trace block) blocks looked up, one lookup per request.
        gpu_hit_blocks / cpu_hit_blocks / miss_blocks: their split; they sum to
            ``lookup_blocks``.
        gpu_hit_tokens / cpu_hit_tokens / miss_tokens: the same in tokens; ``miss_tokens``
            also counts the unpublished tail of each prompt, so the three sum to
            ``prompt_tokens``.
        prefill_tokens: tokens computed by prefill (recomputation included).
        recompute_tokens: prefill tokens of re-admitted requests.
        decode_tokens: tokens decoded.
        store_blocks: blocks handed to ``swap_out`` (write-through or write-on-evict).
        store_skipped_blocks: of those, keys the CPU tier already held (not copied).
        store_declined_blocks: of those, keys the policy's admission control declined (not
            copied; 0 for policies without ``admit``).
        store_dropped_blocks: blocks not stored because the CPU tier had no room.
        store_failed_blocks: blocks whose store copy failed (``TransferError``).
        load_blocks: blocks loaded by ``swap_in`` (CPU prefix hits, first admissions and
            re-admissions).
        preemptions / preempt_blocks: requests preempted, and their private blocks swapped out.
        preempt_recomputes: preemptions whose private blocks could not be swapped out (no CPU
            room, or the copy failed) and are recomputed instead.
        resumes / resume_blocks: re-admissions of preempted requests and the blocks
            ``resume`` swapped back in.
        resume_gpu_hit_blocks / resume_cpu_hit_blocks: prefix hits of re-admissions.
        pages_verified / page_mismatches: loaded pages checked, and those with a wrong
            fingerprint.
        steps: scheduler steps (one ``manager.step()`` each). virtual_s: simulated seconds.
        step_host_s: ``StepReport.host_s`` of every step (seconds).
        ttft_s: virtual time from arrival to the end of prefill, per finished request.
        d2h / h2d: per-direction sums of the step reports.
    """

    requests_arrived: int = 0
    requests_done: int = 0
    requests_rejected: int = 0
    prompt_tokens: int = 0
    lookup_blocks: int = 0
    gpu_hit_blocks: int = 0
    cpu_hit_blocks: int = 0
    miss_blocks: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    miss_tokens: int = 0
    prefill_tokens: int = 0
    recompute_tokens: int = 0
    decode_tokens: int = 0
    store_blocks: int = 0
    store_skipped_blocks: int = 0
    store_declined_blocks: int = 0
    store_dropped_blocks: int = 0
    store_failed_blocks: int = 0
    load_blocks: int = 0
    preemptions: int = 0
    preempt_blocks: int = 0
    preempt_recomputes: int = 0
    resumes: int = 0
    resume_blocks: int = 0
    resume_gpu_hit_blocks: int = 0
    resume_cpu_hit_blocks: int = 0
    pages_verified: int = 0
    page_mismatches: int = 0
    steps: int = 0
    virtual_s: float = 0.0
    step_host_s: list[float] = attrs.field(factory=list)
    ttft_s: list[float] = attrs.field(factory=list)
    d2h: DirectionReport = attrs.field(factory=DirectionReport)
    h2d: DirectionReport = attrs.field(factory=DirectionReport)

    def count_admission(
        self,
        *,
        is_first: bool,
        prompt_tokens: int,
        num_keys: int,
        gpu_hits: int,
        cpu_hits: int,
        block_size: int,
    ) -> None:
        """Count one admission: ``num_keys`` prefix blocks looked up, the leading ``gpu_hits``
        found in the GPU cache and the next ``cpu_hits`` in the CPU tier. Only a request's first
        admission enters the hit ratio; later ones count as resumes."""
        if not is_first:
            self.resumes += 1
            self.resume_gpu_hit_blocks += gpu_hits
            self.resume_cpu_hit_blocks += cpu_hits
            return
        self.prompt_tokens += prompt_tokens
        self.lookup_blocks += num_keys
        self.gpu_hit_blocks += gpu_hits
        self.cpu_hit_blocks += cpu_hits
        self.miss_blocks += num_keys - gpu_hits - cpu_hits
        self.gpu_hit_tokens += gpu_hits * block_size
        self.cpu_hit_tokens += cpu_hits * block_size
        self.miss_tokens += prompt_tokens - (gpu_hits + cpu_hits) * block_size
