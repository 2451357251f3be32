"""The simulated serving loop: a virtual clock driving the scheduler and kvmgr's manager.

Offers:
    SimConfig       every knob of one simulation run (frozen, validated)
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
import torch

from kvmgr.config import ManagerConfig
from kvmgr.errors import ConfigError
from kvmgr.manager import OffloadManager
from kvmgr.policy import POLICIES
from kvmgr.policy.opt import FutureUses
from kvmgr.sim.ceiling import reuse_ceiling
from kvmgr.sim.counters import SimCounters
from kvmgr.sim.keys import BlockKeyer
from kvmgr.sim.pages import PageStore
from kvmgr.sim.presets import MODEL_PRESETS, get_preset
from kvmgr.sim.report import SimReport
from kvmgr.sim.request import SimRequest
from kvmgr.sim.scheduler import WRITE_POLICIES, Scheduler, SchedulerConfig
from kvmgr.sim.trace import TRACE_BLOCK_TOKENS, TraceRequest
from kvmgr.transfer.engine import TransferEngine

__all__ = ["ProgressFn", "SimConfig", "run_simulation", "simulate"]

ProgressFn = Callable[[int, int], None]
"""Called now and then with (requests finished or rejected, requests in the run)."""

_ENGINES = ("auto", "host", "cuda", "kernel")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@attrs.frozen(kw_only=True)
class SimConfig:
    """One simulation run. Capacities of ``None`` mean unbounded: enough blocks for every
    distinct prefix block of the run plus every request's private blocks.

    Attributes:
        model: geometry preset (``MODEL_PRESETS``).
        block_size: tokens per block; divides 512.
        gpu_tokens / cpu_tokens: tier capacities in tokens (rounded up to blocks), or ``None``.
        policy: CPU eviction policy, a name of ``kvmgr.policy.POLICIES``; ``"opt"`` is the
            offline optimum (it is given the trace's future), policies taking a ``clock``
            get the virtual clock.
        write_policy: ``"through"`` (store prefix blocks when filled) or ``"evict"`` (when the
            GPU cache evicts them).
        engine: ``"auto"`` (host engine without CUDA), ``"host"``, ``"cuda"``, ``"kernel"``.
        seed: seeds the page fingerprint salts (a ``random.Random``; no global state).
        time_scale: arrival times are multiplied by this (< 1 compresses the trace).
        max_batched_tokens: token budget of a step. max_seqs: requests running at once.
        watermark: fraction of GPU blocks kept available when admitting.
        step_ms / tokens_per_s / h2d_gbps: the cost model of one step (see the module).
        tp: tensor-parallel ranks; each moves 1/tp of the loaded bytes over its own link (GQA
            heads split across ranks: ``h2d_gbps`` is one rank's link).
        max_memory_bytes: refuse runs whose GPU + CPU pages would exceed this.
        fail_rate: fraction of store batches (GPU -> CPU) that a ``kvmgr.testing.FaultyEngine``
            fails on purpose (a soak of the failure paths; failed stores are counted and their
            blocks recomputed later). Loads are never failed: a failed load aborts the run.
    """

    model: str = attrs.field(default="tiny")
    block_size: int = 64
    gpu_tokens: int | None = 1_000_000
    cpu_tokens: int | None = 16_000_000
    policy: str = "lru"
    write_policy: str = "through"
    engine: str = "auto"
    seed: int = 0
    time_scale: float = 1.0
    max_batched_tokens: int = 8192
    max_seqs: int = 128
    watermark: float = 0.01
    step_ms: float = 30.0
    tokens_per_s: float = 60_000.0
    h2d_gbps: float = 25.0
    tp: int = 1
    max_memory_bytes: int = 8 << 30
    fail_rate: float = 0.0

    def __attrs_post_init__(self) -> None:
        _check(
            0.0 <= self.fail_rate <= 1.0,
            f"fail_rate: expected a fraction in [0, 1], got {self.fail_rate!r}",
        )
        _check(
            self.model in MODEL_PRESETS,
            f"model: expected one of {list(MODEL_PRESETS)}, got {self.model!r}",
        )
        _check(
            self.block_size >= 1 and TRACE_BLOCK_TOKENS % self.block_size == 0,
            f"block_size: expected a divisor of {TRACE_BLOCK_TOKENS}, got {self.block_size}",
        )
        page = get_preset(self.model).page_bytes(self.block_size)
        _check(
            page % 8 == 0 and page >= 32,
            f"block_size: model {self.model!r} pages would be {page} B; need a multiple of "
            "8 and >= 32 (use a larger block size)",
        )
        for name in ("gpu_tokens", "cpu_tokens"):
            value = getattr(self, name)
            _check(
                value is None or value >= self.block_size,
                f"{name}: expected >= block_size ({self.block_size}) or unbounded, got {value}",
            )
        _check(
            self.policy in POLICIES,
            f"policy: expected one of {sorted(POLICIES)}, got {self.policy!r}",
        )
        _check(
            self.write_policy in WRITE_POLICIES,
            f"write_policy: expected one of {WRITE_POLICIES}, got {self.write_policy!r}",
        )
        _check(self.engine in _ENGINES, f"engine: expected one of {_ENGINES}, got {self.engine!r}")
        _check(self.time_scale > 0, f"time_scale: expected > 0, got {self.time_scale}")
        _check(
            self.max_batched_tokens >= 1 and self.max_seqs >= 1,
            "max_batched_tokens and max_seqs: expected >= 1",
        )
        _check(0 <= self.watermark < 0.5, f"watermark: expected [0, 0.5), got {self.watermark}")
        _check(
            self.step_ms >= 0 and self.tokens_per_s > 0 and self.h2d_gbps > 0,
            "cost model: expected step_ms >= 0, tokens_per_s > 0, h2d_gbps > 0",
        )
        _check(self.tp >= 1, f"tp: expected >= 1 ranks, got {self.tp}")


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
    _check(len(requests) > 0, "the trace holds no requests")
    ceiling = reuse_ceiling(requests)
    gpu_blocks, cpu_blocks = _capacities(config, requests, ceiling.num_distinct_blocks)
    preset = get_preset(config.model)
    block_bytes = preset.block_bytes(config.block_size)
    total = (gpu_blocks + cpu_blocks) * block_bytes
    _check(
        total <= config.max_memory_bytes,
        f"the run needs {total / 2**30:.2f} GiB of pages ({gpu_blocks} GPU + {cpu_blocks} CPU "
        f"blocks x {block_bytes} B); lower the capacities or raise --max-memory-gib",
    )
    device = "cpu" if config.engine == "host" or not _has_cuda() or _is_host(engine) else "cuda"
    engine_name = "host" if config.engine == "auto" and device == "cpu" else config.engine
    rng = random.Random(config.seed)
    pages = PageStore(
        gpu_blocks,
        [preset.page_bytes(config.block_size)] * preset.num_tensors,
        device,
        seed=rng.getrandbits(63),
    )
    clock = _VirtualClock()
    options, on_admit = _policy_options(config, requests, clock)
    manager_config = ManagerConfig(
        num_cpu_blocks=cpu_blocks,
        policy=config.policy,
        engine=engine_name,
        manage_gpu_blocks=False,
        policy_options=options,
    )
    if engine is None and config.fail_rate > 0:
        from kvmgr.testing import FaultyEngine
        from kvmgr.transfer import Direction, make_engine

        engine = FaultyEngine(
            make_engine(engine_name, torch.device(device), manager_config),
            fail_rate=config.fail_rate,
            seed=config.seed,
            fail_directions=(Direction.D2H,),
        )
    counters = SimCounters()
    start = time.perf_counter()
    async with OffloadManager(pages.tensors, manager_config, engine=engine) as manager:
        scheduler = Scheduler(
            _scheduler_config(config, gpu_blocks), manager, pages, counters, on_admit=on_admit
        )
        await _drive(config, requests, scheduler, manager, block_bytes, progress, clock)
        stats = manager.statistics()
        declined = int(getattr(getattr(manager, "policy", None), "num_declined", 0))
        counters.store_declined_blocks = declined  # reported by the manager as skipped
        counters.store_skipped_blocks -= declined
    return SimReport.build(
        config=config,
        counters=counters,
        ceiling=ceiling,
        stats=stats,
        gpu_evictions=scheduler.gpu.num_evicted,
        wall_s=time.perf_counter() - start,
        engine_used=engine_name if engine is None else engine.name,
        gpu_blocks=gpu_blocks,
        cpu_blocks=cpu_blocks,
        block_bytes=block_bytes,
        page_bytes=preset.page_bytes(config.block_size),
        num_tensors=preset.num_tensors,
        num_requests=len(requests),
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


def _scheduler_config(config: SimConfig, gpu_blocks: int) -> SchedulerConfig:
    return SchedulerConfig(
        block_size=config.block_size,
        max_batched_tokens=config.max_batched_tokens,
        max_seqs=config.max_seqs,
        write_policy=config.write_policy,
        watermark_blocks=int(gpu_blocks * config.watermark),
    )


def _capacities(
    config: SimConfig, requests: Sequence[TraceRequest], distinct_trace_blocks: int
) -> tuple[int, int]:
    bs = config.block_size
    unbounded = distinct_trace_blocks * (TRACE_BLOCK_TOKENS // bs) + sum(
        -(-(r.input_length + r.output_length) // bs)
        - r.num_full_trace_blocks * (TRACE_BLOCK_TOKENS // bs)
        for r in requests
    )
    largest = max(-(-(r.input_length + r.output_length) // bs) for r in requests)
    gpu = unbounded + largest if config.gpu_tokens is None else -(-config.gpu_tokens // bs)
    cpu = unbounded if config.cpu_tokens is None else -(-config.cpu_tokens // bs)
    return gpu, cpu


def _is_host(engine: TransferEngine | None) -> bool:
    """Whether a given engine copies between CPU tensors (looking through wrappers)."""
    from kvmgr.transfer import HostEngine

    while engine is not None and not isinstance(engine, HostEngine):
        engine = getattr(engine, "inner", None)
    return engine is not None


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())
