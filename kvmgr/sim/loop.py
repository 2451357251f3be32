"""The simulated serving loop: a virtual clock driving the scheduler and kvmgr's manager.

Offers:
    SimConfig       every knob of one simulation run (``kvmgr.sim.config``, re-exported)
    simulate        run it (synchronously) and return a ``SimReport``
    run_simulation  the same, as a coroutine, for callers that own an event loop

Requests arrive at their trace timestamps times ``time_scale``. Each step the scheduler plans
decodes, prefill chunks and admissions, the step's tokens are "computed", the manager's
``step()`` submits the queued swaps (exactly once per scheduler step) and the swaps are awaited
and verified. The virtual clock then advances by the cost model: ``step_ms`` +
``tokens / tokens_per_s`` + ``loaded bytes / (tp * h2d_gbps)`` (loads are waited for; stores
overlap compute; under tensor parallelism each of the ``tp`` ranks moves 1/tp of every page over
its own link, in parallel). With nothing to do the clock jumps to the next arrival.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvmgr.config import ManagerConfig
from kvmgr.manager import OffloadManager
from kvmgr.policy import POLICIES
from kvmgr.policy.opt import FutureUses
from kvmgr.sim.ceiling import ReuseCeiling, reuse_ceiling
from kvmgr.sim.config import RunSize, SimConfig, check, scheduler_config
from kvmgr.sim.counters import SimCounters
from kvmgr.sim.engines import device_and_engine, failing_stores
from kvmgr.sim.keys import BlockKeyer
from kvmgr.sim.pages import PageStore
from kvmgr.sim.report import SimReport
from kvmgr.sim.request import SimRequest
from kvmgr.sim.scheduler import Scheduler
from kvmgr.sim.trace import TraceRequest
from kvmgr.transfer.engine import TransferEngine

__all__ = ["ProgressFn", "SimConfig", "run_simulation", "simulate"]

ProgressFn = Callable[[int, int], None]
"""Called now and then with (requests finished or rejected, requests in the run)."""


def simulate(
    config: SimConfig,
    requests: Sequence[TraceRequest],
    *,
    progress: ProgressFn | None = None,
    engine: TransferEngine | None = None,
) -> SimReport:
    """Run one simulation to the end (its own event loop). See ``run_simulation``."""
    return asyncio.run(run_simulation(config, requests, progress=progress, engine=engine))


async def run_simulation(
    config: SimConfig,
    requests: Sequence[TraceRequest],
    *,
    progress: ProgressFn | None = None,
    engine: TransferEngine | None = None,
) -> SimReport:
    """Replay ``requests`` through the simulated serving loop.

    Args:
        config: the run's settings.
        requests: the trace, sorted by arrival.
        progress: called every few hundred steps and at the end.
        engine: an engine instance for the manager instead of ``config.engine`` (for example
            a ``kvmgr.testing.FaultyEngine``); the manager closes it.

    Returns:
        The report; ``report.page_mismatches`` must be 0 (the CLI fails otherwise).

    Raises:
        ConfigError: the run needs more memory than ``config.max_memory_bytes``, or a device
            the engine cannot use.
        TransferError: a copy failed.
    """
    check(len(requests) > 0, "the trace holds no requests")
    ceiling = reuse_ceiling(requests)
    size = RunSize.of(config, requests, ceiling.num_distinct_blocks)
    device, engine_name = device_and_engine(config, engine)
    clock = _VirtualClock()
    options, on_admit = _policy_options(config, requests, clock)
    manager_config = ManagerConfig(
        num_cpu_blocks=size.cpu_blocks,
        policy=config.policy,
        engine=engine_name,
        manage_gpu_blocks=False,
        policy_options=options,
    )
    engine = failing_stores(config, engine_name, device, manager_config, given=engine)
    plan = _RunPlan(config, requests, ceiling, size, device, manager_config, on_admit, clock)
    return await _replay(plan, engine, progress)


@attrs.frozen
class _RunPlan:
    """What ``run_simulation`` settled before the manager starts."""

    config: SimConfig
    requests: Sequence[TraceRequest]
    ceiling: ReuseCeiling
    size: RunSize
    device: str
    manager_config: ManagerConfig
    on_admit: Callable[[int], None] | None
    clock: _VirtualClock


async def _replay(
    plan: _RunPlan, engine: TransferEngine | None, progress: ProgressFn | None
) -> SimReport:
    """Run the manager and the scheduler over the trace; the report of the run."""
    config, requests, size = plan.config, plan.requests, plan.size
    pages = PageStore(
        size.gpu_blocks,
        [size.page_bytes] * size.num_tensors,
        plan.device,
        seed=random.Random(config.seed).getrandbits(63),
    )
    counters = SimCounters()
    start = time.perf_counter()
    async with OffloadManager(pages.tensors, plan.manager_config, engine=engine) as manager:
        sched_config = scheduler_config(config, size.gpu_blocks)
        scheduler = Scheduler(sched_config, manager, pages, counters, on_admit=plan.on_admit)
        _give_oracle_hints(scheduler, config, requests)
        await _drive(config, requests, scheduler, manager, size.block_bytes, progress, plan.clock)
        stats = manager.statistics()
        declined = int(getattr(getattr(manager, "policy", None), "num_declined", 0))
        counters.store_declined_blocks = declined  # reported by the manager as skipped
        counters.store_skipped_blocks -= declined
    return SimReport.build(
        config=config,
        counters=counters,
        ceiling=plan.ceiling,
        stats=stats,
        gpu_evictions=scheduler.gpu.num_evicted,
        wall_s=time.perf_counter() - start,
        engine_used=plan.manager_config.engine if engine is None else engine.name,
        **attrs.asdict(size),
        num_requests=len(requests),
    )


def _give_oracle_hints(
    scheduler: Scheduler, config: SimConfig, requests: Sequence[TraceRequest]
) -> None:
    """With ``config.hint_precision`` set: every store gets an oracle ``StoreHint``."""
    if config.hint_precision is None:
        return
    from kvmgr.sim.hints import oracle_hints

    scheduler.swaps.hints = oracle_hints(
        requests,
        config.hint_precision,
        config.hint_recall,
        horizon_s=config.hint_horizon_s,
        seed=config.seed,
    )


async def _drive(
    config: SimConfig,
    requests: Sequence[TraceRequest],
    scheduler: Scheduler,
    manager: Any,
    block_bytes: int,
    progress: ProgressFn | None,
    clock: _VirtualClock,
) -> None:
    counters = scheduler.counters
    arrivals = [r.arrival_s * config.time_scale for r in requests]
    now_s, next_index = 0.0, 0
    while next_index < len(requests) or not scheduler.is_idle:
        clock.now_s = now_s
        while next_index < len(requests) and arrivals[next_index] <= now_s:
            scheduler.add(SimRequest(next_index, requests[next_index]))
            next_index += 1
        if scheduler.is_idle:
            if next_index < len(requests):
                now_s = max(now_s, arrivals[next_index])
            continue
        now_s += await run_step(config, scheduler, manager, block_bytes, now_s)
        if progress is not None and counters.steps % 256 == 0:
            progress(counters.requests_done + counters.requests_rejected, len(requests))
    counters.virtual_s = now_s
    if progress is not None:
        progress(counters.requests_done + counters.requests_rejected, len(requests))


class _VirtualClock:
    """The simulation's virtual time in seconds, read by policies that take a ``clock``."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _policy_options(
    config: SimConfig, requests: Sequence[TraceRequest], clock: _VirtualClock
) -> tuple[dict[str, Any], Callable[[int], None] | None]:
    """Constructor options of the run's policy and the scheduler's admission hook.

    ``opt`` gets the future of the trace (the prefix keys of every request at the run's
    block size) and each admitted request is consumed from it; a policy whose constructor
    takes ``clock`` gets the virtual clock.
    """
    if config.policy == "opt":
        keyer = BlockKeyer(config.block_size)
        future = FutureUses([keyer.prefix_keys(r) for r in requests])
        return {"future": future}, future.consume
    if "clock" in inspect.signature(POLICIES[config.policy]).parameters:
        return {"clock": clock}, None
    return {}, None


async def run_step(
    config: SimConfig, scheduler: Scheduler, manager: Any, block_bytes: int, now_s: float
) -> float:
    """One scheduler step: schedule, compute (virtually), ``manager.step()``, settle the swaps;
    returns the step's virtual seconds by the cost model of the module docstring."""
    counters = scheduler.counters
    loads_before = counters.load_blocks + counters.resume_blocks
    plan = scheduler.schedule()
    loaded = (counters.load_blocks + counters.resume_blocks - loads_before) * block_bytes
    step_s = (
        config.step_ms / 1e3
        + plan.num_tokens / config.tokens_per_s
        + loaded / (config.tp * config.h2d_gbps * 1e9)  # each rank: 1/tp of the bytes
    )
    scheduler.execute(plan, now_s + step_s)
    report = await manager.step()
    await scheduler.swaps.settle()
    _count_step(counters, report)
    return step_s


def _count_step(counters: SimCounters, report: Any) -> None:
    counters.steps += 1
    counters.step_host_s.append(report.host_s)
    counters.d2h = _add(counters.d2h, report.d2h)
    counters.h2d = _add(counters.h2d, report.h2d)


def _add(a: Any, b: Any) -> Any:
    if not b.batches:
        return a
    return attrs.evolve(
        a, **{f.name: getattr(a, f.name) + getattr(b, f.name) for f in attrs.fields(type(a))}
    )
