"""The hybrid-model simulation: a trace's prompts through a ``GroupedManager``, against the same
model with every layer treated as full attention.

Offers:
    VARIANTS          the ways a run keeps the model's cache (below)
    HybridSimConfig   one run: preset, block size, CPU budget, variants, trace limit
    VariantResult     one variant's figures: hit ratio, bytes moved per hit, bytes stored
    simulate_hybrid   run every variant over one trace (synchronously)

Each request of the trace (in arrival order) looks its prompt up in the CPU tier, loads the
plan of the longest restorable boundary (at most ``input_length - 1`` tokens: the last prompt
token is computed to sample), then stores its prompt's full blocks. Only the CPU tier is
modelled (no GPU prefix cache, no timing): the figures isolate what the group rules change.
The managers hold pages of 8 bytes (the host engine really copies them); bytes are counted
with the preset's real page sizes.

Variants, all with the same CPU budget in bytes, split between groups in proportion to the
bytes each would store over the trace:

- ``full``: every group treated as full attention (a hit needs every block of every layer,
  and a load moves them all): what a manager with one key space does.
- ``all``: the group rules; window and recurrent groups store every block as it is computed
  (any boundary can be restored).
- ``tail``: the group rules; window and recurrent groups store only what the request's last
  boundary needs (its window, its state): the next turn of a conversation restores there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import attrs
import torch

from kvmgr.config import ManagerConfig
from kvmgr.errors import ConfigError, PoolExhaustedError
from kvmgr.groups.manager import GroupedManager
from kvmgr.groups.restore import RestorePlan
from kvmgr.groups.spec import GroupedLayout, GroupSpec
from kvmgr.sim._ratio import TokenRatio
from kvmgr.sim.hybrid_presets import HybridPreset, get_hybrid
from kvmgr.sim.keys import BlockKeyer
from kvmgr.sim.trace import TRACE_BLOCK_TOKENS, TraceRequest

__all__ = ["VARIANTS", "HybridSimConfig", "VariantResult", "simulate_hybrid"]

VARIANTS = ("full", "all", "tail")
_SIM_PAGE_BYTES = 8


def _variants(instance: object, attribute: object, value: tuple[str, ...]) -> None:
    if not value or any(v not in VARIANTS for v in value):
        raise ConfigError(f"variants: expected some of {list(VARIANTS)}, got {list(value)}")


@attrs.frozen(kw_only=True)
class HybridSimConfig:
    """One hybrid simulation.

    Attributes:
        preset: a ``HYBRID_PRESETS`` name.
        block_size: tokens per block of every group; divides ``TRACE_BLOCK_TOKENS`` (512).
        cpu_bytes: the CPU tier's budget in bytes (all groups together).
        variants: which of ``VARIANTS`` to run, in order.
        policy: the eviction policy of every group's manager.

    Raises:
        ConfigError: an unknown preset or variant, a bad block size or budget.
    """

    preset: str = "gpt-oss-120b"
    block_size: int = 512
    cpu_bytes: int = 64 * 2**30
    variants: tuple[str, ...] = attrs.field(default=VARIANTS, converter=tuple, validator=_variants)
    policy: str = "lru"

    def __attrs_post_init__(self) -> None:
        get_hybrid(self.preset)
        if self.block_size < 1 or TRACE_BLOCK_TOKENS % self.block_size:
            raise ConfigError(f"block_size: expected a divisor of {TRACE_BLOCK_TOKENS}")
        if self.cpu_bytes < 1:
            raise ConfigError(f"cpu_bytes: expected > 0, got {self.cpu_bytes}")
        ManagerConfig(num_cpu_blocks=1, engine="host", policy=self.policy)  # a known policy


@attrs.frozen(kw_only=True)
class VariantResult(TokenRatio):
    """One variant of a run (totals over the trace).

    Attributes:
        variant: a ``VARIANTS`` name.
        num_requests: requests replayed.
        num_hits: requests whose lookup restored at least one boundary.
        prompt_tokens: prompt tokens of all requests.
        hit_tokens: prompt tokens restored from the CPU tier instead of computed.
        bytes_loaded: bytes the loads moved (the preset's real page sizes).
        bytes_stored: bytes the stores moved.
        cpu_blocks: CPU blocks of each group's tier (the budget's split).
        orphans_dropped: blocks the grouped manager dropped because another group's eviction
            left no restorable boundary that needs them.
        stores_rejected: stores that found no room in some group (``PoolExhaustedError``).
        wall_s: seconds the variant took.
    """

    variant: str
    num_requests: int
    num_hits: int
    prompt_tokens: int
    hit_tokens: int
    bytes_loaded: int
    bytes_stored: int
    cpu_blocks: tuple[int, ...]
    orphans_dropped: int
    stores_rejected: int
    wall_s: float

    @property
    def hit_ratio(self) -> float:
        """Prompt tokens restored / prompt tokens (``ratio``)."""
        return self.ratio

    @property
    def bytes_per_hit(self) -> float:
        """Bytes loaded per request that hit."""
        return self.bytes_loaded / self.num_hits if self.num_hits else 0.0

    @property
    def bytes_per_hit_token(self) -> float:
        """Bytes loaded per restored prompt token."""
        return self.bytes_loaded / self.hit_tokens if self.hit_tokens else 0.0


def _stored_blocks(spec: GroupSpec, n_blocks: int, tail: bool) -> range:
    """Logical blocks of a prompt of ``n_blocks`` full blocks the group stores."""
    if spec.kind.needs_prefix or not tail:
        return range(n_blocks)
    return spec.live_blocks(n_blocks * spec.block_size)


def _cpu_split(
    layout: GroupedLayout, counts: Sequence[int], cpu_bytes: int, tail: bool
) -> list[int]:
    """CPU blocks per group: the budget split in proportion to the bytes stored."""
    want = [0] * len(layout.groups)
    for n in counts:
        for g, spec in enumerate(layout.groups):
            want[g] += len(_stored_blocks(spec, n, tail)) * spec.block_bytes
    total = sum(want) or 1
    return [
        max(1, cpu_bytes * w // total // spec.block_bytes)
        for w, spec in zip(want, layout.groups, strict=True)
    ]


def _tiny(layout: GroupedLayout) -> GroupedLayout:
    """The same groups with one ``_SIM_PAGE_BYTES`` page each (what the managers hold)."""
    specs = [attrs.evolve(g, page_bytes=(_SIM_PAGE_BYTES,)) for g in layout.groups]
    return GroupedLayout(specs, hash_block_size=layout.hash_block_size)


def _manager(tiny: GroupedLayout, cpu: Sequence[int], num_gpu: int, policy: str) -> GroupedManager:
    """A manager over ``tiny`` with ``num_gpu`` random GPU blocks and ``cpu[g]`` CPU blocks."""
    gen = torch.Generator().manual_seed(0)
    gpu = {
        g.name: [
            torch.randint(1, 256, (num_gpu, _SIM_PAGE_BYTES), dtype=torch.uint8, generator=gen)
        ]
        for g in tiny.groups
    }
    template = ManagerConfig(
        num_cpu_blocks=1, engine="host", manage_gpu_blocks=False, policy=policy
    )
    return GroupedManager.create(
        tiny, gpu, {g.name: n for g, n in zip(tiny.groups, cpu, strict=True)}, template
    )


async def _load(mgr: GroupedManager, plan: RestorePlan, real: GroupedLayout) -> int:
    """Load a hit's blocks into GPU blocks ``0..``; the bytes ``real`` would move."""
    dst = {g.name: list(range(b.stop)) for g, b in zip(mgr.layout.groups, plan.blocks, strict=True)}
    done = mgr.load(plan, dst)
    await mgr.step()
    await done
    return sum(len(b) * g.block_bytes for b, g in zip(plan.blocks, real.groups, strict=True))


async def _store(
    mgr: GroupedManager, hashes: Sequence[bytes], real: GroupedLayout, tail: bool
) -> int | None:
    """Store a prompt's blocks (the tail variant: only those a restore needs); the bytes
    ``real`` would move, ``None`` where some group had no room."""
    tiny = mgr.layout
    tables: dict[str, list[int | None]] = {}
    for g, spec in enumerate(tiny.groups):
        keep = _stored_blocks(spec, tiny.num_blocks(g, len(hashes)), tail)
        tables[spec.name] = [j if j in keep else None for j in range(keep.stop)]
    try:
        done_store = mgr.store(hashes, tables)
    except PoolExhaustedError:
        return None
    await mgr.step()
    result = await done_store
    mgr.take_events()
    return sum(
        r.num_blocks * g.block_bytes
        for r, g in zip(result.results, real.groups, strict=True)
        if r is not None
    )


async def _run_variant(
    preset: HybridPreset, config: HybridSimConfig, variant: str, trace: Sequence[TraceRequest]
) -> VariantResult:
    start = time.perf_counter()
    real = preset.layout(config.block_size, as_full=variant == "full")
    tiny, tail = _tiny(real), variant == "tail"
    keyer = BlockKeyer(config.block_size)
    prompts = [keyer.prefix_keys(r) for r in trace]
    cpu = _cpu_split(real, [len(h) for h in prompts], config.cpu_bytes, tail)
    num_gpu = max(1, max((len(h) for h in prompts), default=1))
    mgr = _manager(tiny, cpu, num_gpu, config.policy)
    hits = hit_tokens = loaded = stored = rejected = 0
    async with mgr:
        for request, hashes in zip(trace, prompts, strict=True):
            if not hashes:
                continue
            plan = mgr.lookup(hashes, max_tokens=request.input_length - 1)
            if plan.is_hit:
                hits += 1
                hit_tokens += plan.num_tokens
                loaded += await _load(mgr, plan, real)
            num_stored = await _store(mgr, hashes, real, tail)
            rejected += num_stored is None
            stored += num_stored or 0
    return VariantResult(
        variant=variant,
        num_requests=len(trace),
        num_hits=hits,
        prompt_tokens=sum(r.input_length for r in trace),
        hit_tokens=hit_tokens,
        bytes_loaded=loaded,
        bytes_stored=stored,
        cpu_blocks=tuple(cpu),
        orphans_dropped=mgr.num_orphans_dropped,
        stores_rejected=rejected,
        wall_s=time.perf_counter() - start,
    )


def simulate_hybrid(config: HybridSimConfig, trace: Sequence[TraceRequest]) -> list[VariantResult]:
    """Run every variant of ``config`` over ``trace``, one after the other, in one process.

    Raises:
        ConfigError: as ``HybridSimConfig``.
    """
    preset = get_hybrid(config.preset)

    async def main() -> list[VariantResult]:
        return [await _run_variant(preset, config, v, trace) for v in config.variants]

    return asyncio.run(main())
