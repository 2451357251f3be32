"""The settings of one simulation run (``SimConfig``) and what they size.

Offers:
    SimConfig           every knob of one simulation run (frozen, validated)
    RunSize             the blocks and bytes of a run, checked against its memory limit
    block_capacities    the GPU and CPU capacities of a run, in blocks
    scheduler_config    the simulated scheduler's settings of a run
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from kvmgr.errors import ConfigError
from kvmgr.policy import POLICIES
from kvmgr.sim.presets import MODEL_PRESETS, get_preset
from kvmgr.sim.scheduler import WRITE_POLICIES, SchedulerConfig
from kvmgr.sim.trace import TRACE_BLOCK_TOKENS, TraceRequest

__all__ = ["RunSize", "SimConfig", "block_capacities", "check", "scheduler_config"]

_ENGINES = ("auto", "host", "cuda", "kernel")


def check(condition: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``condition``."""
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
        hint_precision / hint_recall / hint_horizon_s: give every store an oracle
            ``StoreHint`` (does the conversation continue within ``hint_horizon_s``?) of this
            precision and recall (``kvmgr.sim.hints``); ``None``: no hints. Only policies
            that take hints use them.
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
    hint_precision: float | None = None
    hint_recall: float = 0.75
    hint_horizon_s: float = 300.0

    def __attrs_post_init__(self) -> None:
        self._check_hints()  # in this order: the first bad field of the old single list
        self._check_geometry()
        self._check_policies_and_costs()

    def _check_hints(self) -> None:
        """The oracle hints' precision, recall and horizon."""
        check(
            self.hint_precision is None or 0.0 < self.hint_precision <= 1.0,
            f"hint_precision: expected (0, 1] or None, got {self.hint_precision!r}",
        )
        check(
            0.0 <= self.hint_recall <= 1.0,
            f"hint_recall: expected [0, 1], got {self.hint_recall!r}",
        )
        check(self.hint_horizon_s > 0, f"hint_horizon_s: expected > 0, got {self.hint_horizon_s}")

    def _check_geometry(self) -> None:
        """Fault rate, model, block size and capacities."""
        check(
            0.0 <= self.fail_rate <= 1.0,
            f"fail_rate: expected a fraction in [0, 1], got {self.fail_rate!r}",
        )
        check(
            self.model in MODEL_PRESETS,
            f"model: expected one of {list(MODEL_PRESETS)}, got {self.model!r}",
        )
        check(
            self.block_size >= 1 and TRACE_BLOCK_TOKENS % self.block_size == 0,
            f"block_size: expected a divisor of {TRACE_BLOCK_TOKENS}, got {self.block_size}",
        )
        page = get_preset(self.model).page_bytes(self.block_size)
        check(
            page % 8 == 0 and page >= 32,
            f"block_size: model {self.model!r} pages would be {page} B; need a multiple of "
            "8 and >= 32 (use a larger block size)",
        )
        for name in ("gpu_tokens", "cpu_tokens"):
            value = getattr(self, name)
            check(
                value is None or value >= self.block_size,
                f"{name}: expected >= block_size ({self.block_size}) or unbounded, got {value}",
            )

    def _check_policies_and_costs(self) -> None:
        """Policies, engine, the scheduler's limits and the cost model."""
        check(
            self.policy in POLICIES,
            f"policy: expected one of {sorted(POLICIES)}, got {self.policy!r}",
        )
        check(
            self.write_policy in WRITE_POLICIES,
            f"write_policy: expected one of {WRITE_POLICIES}, got {self.write_policy!r}",
        )
        check(self.engine in _ENGINES, f"engine: expected one of {_ENGINES}, got {self.engine!r}")
        check(
            math.isfinite(self.time_scale) and self.time_scale > 0,
            f"time_scale: expected a finite number > 0, got {self.time_scale}",
        )
        check(
            self.max_batched_tokens >= 1 and self.max_seqs >= 1,
            "max_batched_tokens and max_seqs: expected >= 1",
        )
        check(0 <= self.watermark < 0.5, f"watermark: expected [0, 0.5), got {self.watermark}")
        check(
            math.isfinite(self.step_ms)
            and self.step_ms >= 0
            and self.tokens_per_s > 0
            and self.h2d_gbps > 0,
            "cost model: expected a finite step_ms >= 0, tokens_per_s > 0, h2d_gbps > 0 "
            f"(inf: free), got {self.step_ms}, {self.tokens_per_s}, {self.h2d_gbps}",
        )
        check(self.tp >= 1, f"tp: expected >= 1 ranks, got {self.tp}")


def scheduler_config(config: SimConfig, gpu_blocks: int) -> SchedulerConfig:
    """The simulated scheduler's settings for a run of ``config`` over ``gpu_blocks``."""
    return SchedulerConfig(
        block_size=config.block_size,
        max_batched_tokens=config.max_batched_tokens,
        max_seqs=config.max_seqs,
        write_policy=config.write_policy,
        watermark_blocks=int(gpu_blocks * config.watermark),
    )


def block_capacities(
    config: SimConfig, requests: Sequence[TraceRequest], distinct_trace_blocks: int
) -> tuple[int, int]:
    """``(gpu_blocks, cpu_blocks)`` of a run of ``config`` over ``requests``.

    An unbounded capacity (``None``) is every distinct prefix block of the trace
    (``distinct_trace_blocks`` at 512 tokens, split to ``block_size``) plus every request's
    private blocks; the GPU gets one largest request more. Otherwise tokens round up to blocks.
    """
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


@attrs.frozen
class RunSize:
    """The blocks and bytes of one instance of a run (what ``SimReport.build`` reports).

    Attributes:
        gpu_blocks / cpu_blocks: capacities in blocks (``block_capacities``).
        block_bytes: bytes of one block over every tensor; page_bytes: of one tensor's page.
        num_tensors: KV tensors of the model preset.
    """

    gpu_blocks: int
    cpu_blocks: int
    block_bytes: int
    page_bytes: int
    num_tensors: int

    @classmethod
    def of(
        cls,
        config: SimConfig,
        requests: Sequence[TraceRequest],
        distinct_blocks: int,
        *,
        instances: int = 1,
    ) -> RunSize:
        """Size a run of ``instances`` instances over ``requests``.

        Raises:
            ConfigError: their pages together exceed ``config.max_memory_bytes``.
        """
        gpu_blocks, cpu_blocks = block_capacities(config, requests, distinct_blocks)
        preset = get_preset(config.model)
        block_bytes = preset.block_bytes(config.block_size)
        total = instances * (gpu_blocks + cpu_blocks) * block_bytes
        who = "the run needs" if instances == 1 else f"{instances} instances need"
        check(
            total <= config.max_memory_bytes,
            f"{who} {total / 2**30:.2f} GiB of pages ({gpu_blocks} GPU + {cpu_blocks} CPU "
            f"blocks x {block_bytes} B each); lower the capacities or raise --max-memory-gib",
        )
        page_bytes = preset.page_bytes(config.block_size)
        return cls(gpu_blocks, cpu_blocks, block_bytes, page_bytes, preset.num_tensors)
