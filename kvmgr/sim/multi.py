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
from typing import Any

import attrs

from kvmgr.config import ManagerConfig
from kvmgr.errors import ConfigError
from kvmgr.manager import OffloadManager
from kvmgr.sim.ceiling import ReuseCeiling, reuse_ceiling
from kvmgr.sim.config import RunSize, SimConfig, scheduler_config
from kvmgr.sim.counters import SimCounters
from kvmgr.sim.instance_tiers import (
    disk_file,
    instance_tiers,
    remove_disk_files,
    tier_namespace,
)
from kvmgr.sim.loop import run_step
from kvmgr.sim.multi_report import MultiReport, instance_report, summarize
from kvmgr.sim.pages import PageStore
from kvmgr.sim.request import SimRequest
from kvmgr.sim.scheduler import Scheduler
from kvmgr.sim.trace import TraceRequest

__all__ = ["ROUTES", "MultiReport", "disk_file", "run_instances"]

ROUTES = ("round-robin", "session")


def _route(route: str, index: int, request: TraceRequest, num: int) -> int:
    if route == "round-robin":
        return index % num
    conversation = tuple(request.hash_ids[:2])
    return hash(conversation) % num


@attrs.define(eq=False)
class _Instance:
    scheduler: Scheduler
    manager: OffloadManager
    pages: PageStore
    has_tiers: bool
    fetched_blocks: int = 0
    fetched_tokens: int = 0


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
    ceiling, size = _plan_run(config, requests, num_instances, route)
    shared = shared_url is not None
    seed = random.Random(config.seed).getrandbits(63)
    start = time.perf_counter()
    instances: list[_Instance] = []
    backends: list[Any] = []
    counters = [SimCounters() for _ in range(num_instances)]
    try:
        for i in range(num_instances):
            tiers = instance_tiers(i, shared_url, disk_path, disk_tokens, config, size.block_bytes)
            backends += tiers
            instances.append(await _start_instance(config, size, seed, counters[i], tiers, shared))
        await _drive(config, requests, instances, route, size.block_bytes, progress)
        reports = [
            instance_report(inst, config, ceiling, size, time.perf_counter() - start)
            for inst in instances
        ]
    finally:
        await _close(instances, backends, disk_path, num_instances)
    return summarize(reports, counters, route, shared, time.perf_counter() - start)


def _plan_run(
    config: SimConfig, requests: Sequence[TraceRequest], num_instances: int, route: str
) -> tuple[ReuseCeiling, RunSize]:
    """The trace's reuse ceiling and the run's sizes, after checking the arguments."""
    if num_instances < 1 or route not in ROUTES:
        raise ConfigError(f"expected instances >= 1 and route in {ROUTES}")
    if not requests:
        raise ConfigError("the trace holds no requests")
    ceiling = reuse_ceiling(requests)
    return ceiling, RunSize.of(
        config, requests, ceiling.num_distinct_blocks, instances=num_instances
    )


async def _close(
    instances: list[_Instance], backends: list[Any], disk_path: str | None, num: int
) -> None:
    """Close the managers, then their tiers; delete the ``num`` instances' disk files."""
    for inst in instances:
        await inst.manager.aclose()
    for backend in backends:
        await backend.aclose()
    if disk_path is not None:  # scratch: GBs per instance, and a warm start next time
        for i in range(num):
            remove_disk_files(disk_file(disk_path, i))


async def _start_instance(
    config: SimConfig,
    size: RunSize,
    seed: int,
    counters: SimCounters,
    tiers: list[Any],
    write_through: bool,
) -> _Instance:
    """One instance: its pages, its manager (started) over ``tiers``, its scheduler."""
    pages = PageStore(size.gpu_blocks, [size.page_bytes] * size.num_tensors, "cpu", seed=seed)
    namespace = tier_namespace(config, size.page_bytes, size.num_tensors)
    manager_config = ManagerConfig(
        num_cpu_blocks=size.cpu_blocks,
        policy=config.policy,
        engine="host",
        manage_gpu_blocks=False,
        tier_write_through=write_through,
    )
    manager = OffloadManager(pages.tensors, manager_config, tiers=tiers, tier_namespace=namespace)
    await manager.__aenter__()
    scheduler = Scheduler(scheduler_config(config, size.gpu_blocks), manager, pages, counters)
    return _Instance(scheduler, manager, pages, bool(tiers))


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
