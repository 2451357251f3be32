"""The report of one simulation: figures, JSON form and the rich table.

Offers:
    SimReport       frozen summary of a run (build it with ``SimReport.build``)
    TIMING_FIELDS   fields measured in wall-clock time (excluded when comparing runs)
    render_report   the rich table of one report
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
from rich.table import Table

from kvmgr.reports import DirectionReport
from kvmgr.sim.ceiling import ReuseCeiling
from kvmgr.sim.counters import SimCounters

__all__ = ["TIMING_FIELDS", "SimReport", "render_report"]

#: Fields that depend on the machine's speed, not on the simulation.
TIMING_FIELDS = ("wall_s", "step_host_p50_us", "step_host_p99_us")


_MANAGER_FIELDS = (
    "steps",
    "lookups",
    "lookup_keys",
    "lookup_hits",
    "stores_completed",
    "stores_skipped",
    "stores_failed",
    "loads_completed",
    "loads_failed",
    "evictions",
    "bytes_d2h",
    "bytes_h2d",
)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _percentile_us(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e6) if values else 0.0


@attrs.frozen(kw_only=True)
class SimReport:
    """What a simulation did. Token ratios are fractions of ``prompt_tokens``.

    Attributes:
        settings: the run's configuration and derived capacities (blocks, bytes).
        counters: every total of the run (``SimCounters`` as a dict, lists summarised).
        hit_ratio / gpu_hit_ratio / cpu_hit_ratio / miss_ratio: prompt tokens served from
            either tier / the GPU cache / the CPU tier / computed.
        ceiling_ratio: the trace's own reuse ceiling (infinite cache) over the same requests.
        prefill_tokens_saved: prompt tokens not computed thanks to hits.
        d2h / h2d: per direction: swaps, blocks, pages (descriptors before merging),
            descriptors (after merging), bytes, batches.
        cpu_evictions / gpu_evictions: blocks evicted by each tier.
        manager: totals from ``OffloadManager.statistics()`` (steps, lookups, stores, loads,
            evictions, bytes per direction).
        step_host_p50_us / step_host_p99_us: host time inside ``manager.step()``.
        ttft_p50_s / ttft_p99_s: virtual time to first token.
        wall_s: wall-clock seconds of the run.
    """

    settings: dict[str, Any]
    counters: dict[str, Any]
    hit_ratio: float
    gpu_hit_ratio: float
    cpu_hit_ratio: float
    miss_ratio: float
    ceiling_ratio: float
    prefill_tokens_saved: int
    d2h: dict[str, int]
    h2d: dict[str, int]
    cpu_evictions: int
    gpu_evictions: int
    manager: dict[str, int]
    step_host_p50_us: float
    step_host_p99_us: float
    ttft_p50_s: float
    ttft_p99_s: float
    wall_s: float

    @property
    def page_mismatches(self) -> int:
        """Loaded pages whose fingerprint was wrong (must be 0)."""
        return int(self.counters["page_mismatches"])

    @classmethod
    def build(
        cls,
        *,
        config: Any,
        counters: SimCounters,
        ceiling: ReuseCeiling,
        stats: Any,
        gpu_evictions: int,
        wall_s: float,
        **settings: Any,
    ) -> SimReport:
        """Summarise a finished run (``settings``: derived figures such as block counts)."""
        totals = attrs.asdict(counters, recurse=False)
        step_host_s = totals.pop("step_host_s")
        ttft_s = totals.pop("ttft_s")
        d2h: DirectionReport = totals.pop("d2h")
        h2d: DirectionReport = totals.pop("h2d")
        prompt = counters.prompt_tokens
        saved = counters.gpu_hit_tokens + counters.cpu_hit_tokens
        return cls(
            settings={**attrs.asdict(config), **settings},
            counters=totals,
            hit_ratio=_ratio(saved, prompt),
            gpu_hit_ratio=_ratio(counters.gpu_hit_tokens, prompt),
            cpu_hit_ratio=_ratio(counters.cpu_hit_tokens, prompt),
            miss_ratio=_ratio(counters.miss_tokens, prompt),
            ceiling_ratio=ceiling.ratio,
            prefill_tokens_saved=saved,
            d2h=attrs.asdict(d2h),
            h2d=attrs.asdict(h2d),
            cpu_evictions=int(stats.evictions),
            gpu_evictions=gpu_evictions,
            manager={name: int(getattr(stats, name)) for name in _MANAGER_FIELDS},
            step_host_p50_us=_percentile_us(step_host_s, 50),
            step_host_p99_us=_percentile_us(step_host_s, 99),
            ttft_p50_s=float(np.percentile(ttft_s, 50)) if ttft_s else 0.0,
            ttft_p99_s=float(np.percentile(ttft_s, 99)) if ttft_s else 0.0,
            wall_s=wall_s,
        )

    def to_dict(self, *, timing: bool = True) -> dict[str, Any]:
        """JSON-ready dict; ``timing=False`` drops ``TIMING_FIELDS`` (for comparing runs)."""
        data = attrs.asdict(self)
        if not timing:
            for name in TIMING_FIELDS:
                del data[name]
        return data


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def _direction_row(name: str, d: dict[str, int]) -> tuple[str, str]:
    batches = max(d["batches"], 1)
    return (
        name,
        f"{d['swaps']:,} swaps, {d['blocks']:,} blocks, {_fmt_bytes(d['bytes'])} in "
        f"{d['batches']:,} batches; descriptors/batch {d['pages'] / batches:,.1f} -> "
        f"{d['descriptors'] / batches:,.1f} merged",
    )


def render_report(report: SimReport, title: str = "kvmgr simulate") -> Table:
    """The report as a two-column rich table."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("figure", style="bold")
    table.add_column("value")
    for name, value in [*_setup_rows(report), *_traffic_rows(report)]:
        table.add_row(name, value)
    return table


def _setup_rows(report: SimReport) -> list[tuple[str, str]]:
    """The rows of the run's settings, requests and hit ratio."""
    c, s = report.counters, report.settings
    return [
        (
            "model / block",
            f"{s['model']} ({s['num_tensors']} tensors x {s['page_bytes']:,} B "
            f"pages), block {s['block_size']} tokens",
        ),
        (
            "capacities",
            f"GPU {s['gpu_blocks']:,} blocks ({s['gpu_blocks'] * s['block_size']:,} "
            f"tokens), CPU {s['cpu_blocks']:,} blocks "
            f"({s['cpu_blocks'] * s['block_size']:,} tokens)",
        ),
        (
            "policy",
            f"{s['policy']}, write-{s['write_policy']}, engine {s['engine_used']}, "
            f"seed {s['seed']}",
        ),
        (
            "requests",
            f"{c['requests_done']:,} done / {c['requests_arrived']:,} arrived"
            f" ({c['requests_rejected']:,} rejected)",
        ),
        ("prompt tokens", f"{c['prompt_tokens']:,} (decoded {c['decode_tokens']:,})"),
        (
            "hit ratio",
            f"{report.hit_ratio:.2%} = GPU {report.gpu_hit_ratio:.2%} + CPU "
            f"{report.cpu_hit_ratio:.2%}; miss {report.miss_ratio:.2%}; "
            f"trace ceiling {report.ceiling_ratio:.2%}",
        ),
        (
            "lookups (blocks)",
            f"{c['lookup_blocks']:,} = GPU hit {c['gpu_hit_blocks']:,} + "
            f"CPU hit {c['cpu_hit_blocks']:,} + miss {c['miss_blocks']:,}",
        ),
    ]


def _traffic_rows(report: SimReport) -> list[tuple[str, str]]:
    """The rows of what moved, what it cost and what was verified."""
    c = report.counters
    return [
        (
            "prefill tokens saved",
            f"{report.prefill_tokens_saved:,} (computed "
            f"{c['prefill_tokens']:,}, recomputed {c['recompute_tokens']:,})",
        ),
        _direction_row("swaps GPU->CPU", report.d2h),
        _direction_row("swaps CPU->GPU", report.h2d),
        (
            "stores",
            f"{c['store_blocks']:,} blocks ({c['store_skipped_blocks']:,} already "
            f"stored, {c['store_declined_blocks']:,} declined by admission "
            f"({c['store_declined_blocks'] * report.settings['block_bytes'] / 2**20:,.0f} MiB "
            f"not copied), {c['store_dropped_blocks']:,} dropped: CPU full, "
            f"{c['store_failed_blocks']:,} failed)",
        ),
        ("evictions", f"GPU cache {report.gpu_evictions:,}, CPU tier {report.cpu_evictions:,}"),
        (
            "preemptions",
            f"{c['preemptions']:,} ({c['preempt_blocks']:,} blocks swapped out, "
            f"{c['preempt_recomputes']:,} recomputed), resumes {c['resumes']:,} "
            f"({c['resume_blocks']:,} blocks)",
        ),
        (
            "step() host time",
            f"p50 {report.step_host_p50_us:,.0f} us, "
            f"p99 {report.step_host_p99_us:,.0f} us over {c['steps']:,} steps",
        ),
        ("pages verified", f"{c['pages_verified']:,}, mismatches {c['page_mismatches']:,}"),
        (
            "virtual time",
            f"{c['virtual_s']:,.1f} s; TTFT p50 {report.ttft_p50_s:.2f} s, "
            f"p99 {report.ttft_p99_s:.2f} s",
        ),
        ("wall time", f"{report.wall_s:.1f} s"),
    ]
