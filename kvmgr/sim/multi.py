"""Several serving instances behind a router, optionally sharing a lower tier (issue 16).

Offers:
    MultiReport        per-instance reports and the tier split of the whole run
    run_instances      replay a trace through N instances (coroutine)
    ROUTES             ``round-robin`` | ``session``

Each instance has its own GPU prefix cache, CPU tier (an ``OffloadManager``) and page store;
all share one page fingerprint seed, so a page written by one instance verifies on another.
With a shared tier (a ``SharedTier`` on a Valkey/Redis URL, one client per instance) every
store is written through (``tier_write_through``) and CPU evictions are written back; when a
request arrives at an instance, ``manager.fetch`` stages the prefix blocks the shared tier holds
(after the instance's own CPU prefix) into the CPU tier, where the scheduler's admission finds
them. A local disk tier (``disk_path``) may sit between the CPU tier and the shared tier.

The instances run in lockstep on one virtual clock: each iteration every busy instance runs one
scheduler step; the clock advances by the slowest instance's step (the cost model of
``kvmgr.sim.loop``).

Routing: ``round-robin`` sends request ``i`` to instance ``i % N``; ``session`` sends every
turn of a conversation to one instance, the conversation being identified by the prompt's
first two trace blocks (the shared system prompt and the conversation's own first block).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvmgr.config import ManagerConfig
from kvmgr.errors import ConfigError
from kvmgr.manager import OffloadManager
from kvmgr.sim.ceiling import reuse_ceiling
from kvmgr.sim.counters import SimCounters
from kvmgr.sim.loop import SimConfig, _capacities, _scheduler_config, run_step
from kvmgr.sim.pages import PageStore
from kvmgr.sim.presets import get_preset
from kvmgr.sim.report import SimReport
from kvmgr.sim.request import SimRequest
from kvmgr.sim.scheduler import Scheduler
from kvmgr.sim.trace import TraceRequest

__all__ = ["ROUTES", "MultiReport", "run_instances"]

ROUTES = ("round-robin", "session")


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


def _route(route: str, index: int, request: TraceRequest, num: int) -> int:
    if route == "round-robin":
        return index % num
    conversation = tuple(request.hash_ids[:2])
    return hash(conversation) % num


class _Instance:
    def __init__(
        self, scheduler: Scheduler, manager: OffloadManager, pages: PageStore, has_tiers: bool
    ) -> None:
        self.scheduler = scheduler
        self.has_tiers = has_tiers
        self.manager = manager
        self.pages = pages
        self.fetched_blocks = 0
        self.fetched_tokens = 0


async def run_instances(
    config: SimConfig,
    requests: Sequence[TraceRequest],
    *,
    num_instances: int,
    route: str = "session",
    shared_url: str | None = None,
    disk_path: str | None = None,
    disk_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> MultiReport:
    """Replay ``requests`` through ``num_instances`` instances (see the module docstring).

    ``progress(done, total)``: requests handed to an instance so far, called every few
    hundred rounds of steps and at the end.

    Raises:
        ConfigError: bad arguments, or the run needs more memory than allowed.
    """
    if num_instances < 1 or route not in ROUTES:
        raise ConfigError(f"expected instances >= 1 and route in {ROUTES}")
    if not requests:
        raise ConfigError("the trace holds no requests")
    ceiling = reuse_ceiling(requests)
    gpu_blocks, cpu_blocks = _capacities(config, requests, ceiling.num_distinct_blocks)
    preset = get_preset(config.model)
    page_bytes = preset.page_bytes(config.block_size)
    block_bytes = preset.block_bytes(config.block_size)
    total = num_instances * (gpu_blocks + cpu_blocks) * block_bytes
    if total > config.max_memory_bytes:
        raise ConfigError(
            f"{num_instances} instances need {total / 2**30:.2f} GiB of pages; lower the "
            "capacities or raise --max-memory-gib"
        )
    seed = random.Random(config.seed).getrandbits(63)
    start = time.perf_counter()
    instances: list[_Instance] = []
    backends: list[Any] = []
    counters = [SimCounters() for _ in range(num_instances)]
    try:
        for i in range(num_instances):
            tiers = _tiers(i, shared_url, disk_path, disk_tokens, config, block_bytes)
            backends += tiers
            pages = PageStore(gpu_blocks, [page_bytes] * preset.num_tensors, "cpu", seed=seed)
            namespace = _namespace(config, page_bytes, preset.num_tensors)
            manager_config = ManagerConfig(
                num_cpu_blocks=cpu_blocks,
                policy=config.policy,
                engine="host",
                manage_gpu_blocks=False,
                tier_write_through=shared_url is not None,
            )
            manager = OffloadManager(
                pages.tensors, manager_config, tiers=tiers, tier_namespace=namespace
            )
            await manager.__aenter__()
            scheduler = Scheduler(
                _scheduler_config(config, gpu_blocks), manager, pages, counters[i]
            )
            instances.append(_Instance(scheduler, manager, pages, bool(tiers)))
        await _drive(config, requests, instances, route, block_bytes, progress)
        reports = []
        for i, inst in enumerate(instances):
            stats = inst.manager.statistics()
            tier_stats = inst.manager.tier_statistics()
            reports.append(
                (
                    SimReport.build(
                        config=config,
                        counters=counters[i],
                        ceiling=ceiling,
                        stats=stats,
                        gpu_evictions=inst.scheduler.gpu.num_evicted,
                        wall_s=time.perf_counter() - start,
                        engine_used="host",
                        gpu_blocks=gpu_blocks,
                        cpu_blocks=cpu_blocks,
                        block_bytes=block_bytes,
                        page_bytes=page_bytes,
                        num_tensors=preset.num_tensors,
                        num_requests=counters[i].requests_arrived,
                    ),
                    inst.fetched_tokens,
                    inst.fetched_blocks,
                    sum(b.bytes_demoted for b, _ in tier_stats),
                    sum(b.bytes_promoted for b, _ in tier_stats),
                )
            )
    finally:
        for inst in instances:
            await inst.manager.aclose()
        for backend in backends:
            await backend.aclose()
        if disk_path is not None:  # scratch: GBs per instance, and a warm start next time
            for i in range(num_instances):
                remove_disk_files(disk_file(disk_path, i))
    return _summary(reports, counters, route, shared_url is not None, time.perf_counter() - start)


def _namespace(config: SimConfig, page_bytes: int, num_tensors: int) -> Any:
    from kvmgr.tiers import TierNamespace

    return TierNamespace(
        model=f"sim-{config.model}",
        page_bytes=(page_bytes,) * num_tensors,
        dtype_names=("uint8",) * num_tensors,
        block_size=config.block_size,
    )


def disk_file(disk_path: str | Path, index: int) -> Path:
    """The scratch file of instance ``index``'s disk tier in the folder ``disk_path``."""
    return Path(disk_path) / f"kvmgr-sim-instance-{index}.bin"


def remove_disk_files(path: Path) -> bool:
    """Delete a disk tier's scratch file and its saved index; whether any existed."""
    found = False
    for p in (path, path.with_name(path.name + ".index")):
        if p.exists():
            p.unlink()
            found = True
    return found


def _tiers(
    index: int,
    shared_url: str | None,
    disk_path: str | None,
    disk_tokens: int | None,
    config: SimConfig,
    block_bytes: int,
) -> list[Any]:
    tiers: list[Any] = []
    if disk_path is not None:
        from kvmgr.tiers import DiskTier
        from kvmgr.tiers.blob import HEADER_BYTES

        slots = -(-(disk_tokens or 50_000_000) // config.block_size)
        path = disk_file(disk_path, index)
        remove_disk_files(path)  # a previous run's blocks must not make this run start warm
        tiers.append(
            DiskTier(
                path,
                slot_bytes=HEADER_BYTES + block_bytes,
                num_slots=slots,
                persist_index=False,
            )
        )
    if shared_url is not None:
        from kvmgr.tiers import SharedTier

        tiers.append(SharedTier(shared_url, single_tenant=True))  # one simulated tenant
    return tiers


async def _drive(
    config: SimConfig,
    requests: Sequence[TraceRequest],
    instances: list[_Instance],
    route: str,
    block_bytes: int,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    arrivals = [r.arrival_s * config.time_scale for r in requests]
    now_s, next_index = 0.0, 0
    num, rounds = len(instances), 0
    while next_index < len(requests) or not all(i.scheduler.is_idle for i in instances):
        rounds += 1
        if progress is not None and rounds % 256 == 0:
            progress(next_index, len(requests))
        while next_index < len(requests) and arrivals[next_index] <= now_s:
            trace = requests[next_index]
            inst = instances[_route(route, next_index, trace, num)]
            await _prefetch(inst, trace)
            inst.scheduler.add(SimRequest(next_index, trace))
            next_index += 1
        busy = [i for i in instances if not i.scheduler.is_idle]
        if not busy:
            if next_index < len(requests):
                now_s = max(now_s, arrivals[next_index])
            continue
        step_s = 0.0
        for inst in busy:
            inst_s = await run_step(config, inst.scheduler, inst.manager, block_bytes, now_s)
            step_s = max(step_s, inst_s)
        for inst in busy:  # deterministic: what the next fetch finds must not depend on I/O
            await inst.manager.drain_tiers()
        now_s += step_s
    for inst in instances:
        inst.scheduler.counters.virtual_s = now_s
    if progress is not None:
        progress(len(requests), len(requests))


async def _prefetch(inst: _Instance, trace: TraceRequest) -> None:
    """Stage what the lower tiers hold of the request's prefix into the CPU tier."""
    if not inst.has_tiers:
        return
    keys = inst.scheduler.keyer.prefix_keys(trace)
    before = inst.manager.peek(keys)
    after = await inst.manager.fetch(keys)
    if after > before:
        inst.fetched_blocks += after - before
        inst.fetched_tokens += (after - before) * inst.scheduler.config.block_size


def _summary(
    reports: list[tuple[SimReport, int, int, int, int]],
    counters: list[SimCounters],
    route: str,
    shared: bool,
    wall_s: float,
) -> MultiReport:
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
