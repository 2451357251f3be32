"""The report of a multi-instance run: per-instance reports and the split between tiers.

Offers:
    MultiReport       per-instance reports and the tier split of the whole run
    instance_report   what one finished instance contributes
    summarize         the ``MultiReport`` of a run
"""

from __future__ import annotations

from typing import Any

import attrs

from kvmgr.sim.ceiling import ReuseCeiling
from kvmgr.sim.config import RunSize, SimConfig
from kvmgr.sim.counters import SimCounters
from kvmgr.sim.report import SimReport

__all__ = ["MultiReport", "instance_report", "summarize"]


@attrs.frozen(kw_only=True)
class MultiReport:
    """One multi-instance run.

    Attributes:
        instances: one ``SimReport`` per instance.
        route: the routing rule.
        shared: whether a shared tier was used (its URL is never reported).
        prompt_tokens: prompt tokens of all admitted requests.
        hit_ratio: prompt tokens served from any tier / prompt tokens.
        gpu_hit_ratio / cpu_hit_ratio / lower_hit_ratio: the split: the GPU prefix cache, the
            CPU tier's own blocks, and blocks the instance fetched from its lower tiers.
        fetched_blocks: blocks staged from lower tiers into CPU tiers.
        tier_bytes_written / tier_bytes_read: bytes moved to and from the lower tiers.
        page_mismatches: loaded pages with a wrong fingerprint (must be 0).
        wall_s: seconds the run took.
    """

    instances: tuple[SimReport, ...]
    route: str
    shared: bool
    prompt_tokens: int
    hit_ratio: float
    gpu_hit_ratio: float
    cpu_hit_ratio: float
    lower_hit_ratio: float
    fetched_blocks: int
    tier_bytes_written: int
    tier_bytes_read: int
    page_mismatches: int
    wall_s: float


def instance_report(
    inst: Any, config: SimConfig, ceiling: ReuseCeiling, size: RunSize, wall_s: float
) -> tuple[SimReport, int, int, int, int]:
    """``(report, fetched tokens, fetched blocks, bytes demoted, bytes promoted)`` of one
    finished instance (its ``manager``, ``scheduler`` and fetch counts)."""
    tier_stats = inst.manager.tier_statistics()
    counters = inst.scheduler.counters
    report = SimReport.build(
        config=config,
        counters=counters,
        ceiling=ceiling,
        stats=inst.manager.statistics(),
        gpu_evictions=inst.scheduler.gpu.num_evicted,
        wall_s=wall_s,
        engine_used="host",
        **attrs.asdict(size),
        num_requests=counters.requests_arrived,
    )
    return (
        report,
        inst.fetched_tokens,
        inst.fetched_blocks,
        sum(b.bytes_demoted for b, _ in tier_stats),
        sum(b.bytes_promoted for b, _ in tier_stats),
    )


def summarize(
    reports: list[tuple[SimReport, int, int, int, int]],
    counters: list[SimCounters],
    route: str,
    shared: bool,
    wall_s: float,
) -> MultiReport:
    """The whole run's report from each instance's ``instance_report`` and counters."""
    prompt = sum(c.prompt_tokens for c in counters)
    gpu = sum(c.gpu_hit_tokens for c in counters)
    cpu_all = sum(c.cpu_hit_tokens for c in counters)
    fetched = sum(r[1] for r in reports)
    lower = min(fetched, cpu_all)  # fetched blocks are served as CPU hits
    ratio = (lambda x: x / prompt) if prompt else (lambda x: 0.0)
    return MultiReport(
        instances=tuple(r[0] for r in reports),
        route=route,
        shared=shared,
        prompt_tokens=prompt,
        hit_ratio=ratio(gpu + cpu_all),
        gpu_hit_ratio=ratio(gpu),
        cpu_hit_ratio=ratio(cpu_all - lower),
        lower_hit_ratio=ratio(lower),
        fetched_blocks=sum(r[2] for r in reports),
        tier_bytes_written=sum(r[3] for r in reports),
        tier_bytes_read=sum(r[4] for r in reports),
        page_mismatches=sum(c.page_mismatches for c in counters),
        wall_s=wall_s,
    )
