"""A fast block-granular replay of a trace through one policy (no GPU tier, no bytes moved).

Offers:
    ReplayResult    hit and traffic counts of one replay
    replay          replay requests through ``make_policy(name, blocks, **options)``

Model (the one the offline optimum is exact for): requests are served one at a time in arrival
order; a request's hits are the leading run of its full 512-token trace blocks resident in the
cache (touched in the policy); its other full blocks are then stored (``admit`` first, when the
policy has it), evicting as needed but never the request's own blocks. The policy's clock is the
arrival time. It takes about a second for the bundled trace, so policies are tuned on it and
then checked in the full simulator (``kvmgr simulate``), whose GPU tier changes the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kvmgr.policy import make_policy
from kvmgr.policy.opt import FutureUses
from kvmgr.sim._ratio import TokenRatio
from kvmgr.sim.keys import BlockKeyer
from kvmgr.sim.trace import TRACE_BLOCK_TOKENS, TraceRequest

__all__ = ["ReplayResult", "replay"]


@attrs.frozen(kw_only=True)
class ReplayResult(TokenRatio):
    """Counts of one replay; only requests arriving at or after ``measure_from_s`` count hits.

    Attributes:
        policy: policy name. capacity_blocks: cache size in trace blocks.
        prompt_tokens / hit_tokens: prompt tokens of the measured requests and their hits.
        stored_blocks: blocks written to the cache; rejected_blocks: blocks ``admit`` refused
            (each one is a copy saved); evicted_blocks: blocks evicted.
    """

    policy: str
    capacity_blocks: int
    prompt_tokens: int
    hit_tokens: int
    stored_blocks: int
    rejected_blocks: int
    evicted_blocks: int


def replay(
    requests: Sequence[TraceRequest],
    policy: str,
    capacity_tokens: int,
    *,
    measure_from_s: float = 0.0,
    options: dict[str, Any] | None = None,
    hints: Sequence[Any] | None = None,
) -> ReplayResult:
    """Replay ``requests`` (sorted by arrival) through one policy; see the module docstring.

    Args:
        requests: the trace.
        policy: a registered policy name; ``"opt"`` gets the trace's future automatically.
        capacity_tokens: cache size, rounded down to whole 512-token blocks (>= 1 block).
        measure_from_s: count hits only for requests arriving at or after this time (the
            cache is warmed by the earlier ones).
        options: extra constructor options of the policy (``clock`` is passed by the replay).
        hints: one ``StoreHint`` per request (``kvmgr.sim.hints.oracle_hints``), given to
            ``admit`` of a policy that takes hints.

    Raises:
        ConfigError: unknown policy, capacity below one block, or bad options.
    """
    all_keys = list(map(BlockKeyer(TRACE_BLOCK_TOKENS).prefix_keys, requests))
    now = [0.0]
    capacity = max(0, capacity_tokens // TRACE_BLOCK_TOKENS)
    cache, future = _policy(policy, capacity, options, all_keys, lambda: now[0])
    given = hints if getattr(cache, "takes_hints", False) else None
    tally = dict.fromkeys(_COUNTS, 0)
    for i, (request, keys) in enumerate(zip(requests, all_keys)):
        now[0] = request.arrival_s
        hits = _touch_prefix(cache, keys)
        if future is not None:
            future.consume(i)
        if request.arrival_s >= measure_from_s:
            tally["prompt_tokens"] += request.input_length
            tally["hit_tokens"] += hits * TRACE_BLOCK_TOKENS
        _store_misses(cache, capacity, keys, hits, _NO_HINT if given is None else given[i], tally)
    return ReplayResult(policy=policy, capacity_blocks=capacity, **tally)


_NO_HINT = object()


def _policy(
    policy: str,
    capacity: int,
    options: dict[str, Any] | None,
    all_keys: list[list[bytes]],
    clock: Any,
) -> tuple[Any, FutureUses | None]:
    """The policy of a replay and, for ``opt``, the trace's future it consumes."""
    opts: dict[str, Any] = dict(options or {})
    future = None
    if policy == "opt":
        future = opts["future"] = FutureUses(all_keys)
    else:
        opts.setdefault("clock", clock)
    return make_policy(policy, capacity, **_accepted(policy, opts)), future


def _touch_prefix(cache: Any, keys: list[bytes]) -> int:
    """How many leading ``keys`` the policy holds (touched, as a lookup would)."""
    hits = 0
    for key in keys:
        if key not in cache:
            break
        hits += 1
    cache.touch(keys[:hits])
    return hits


#: what a replay counts, by ``ReplayResult`` field
_COUNTS = ("prompt_tokens", "hit_tokens", "stored_blocks", "rejected_blocks", "evicted_blocks")


def _store_misses(
    cache: Any, capacity: int, keys: list[bytes], hits: int, hint: Any, tally: dict[str, int]
) -> None:
    """Offer a request's missing blocks to the policy (``admit``, with ``hint`` when the policy
    takes hints), keep what fits, evict to make room (never the request's own hits), insert."""
    new = keys[hits:]
    parents = [keys[hits - 1] if hits else None, *new[:-1]][: len(new)]
    admit = getattr(cache, "admit", None)
    if admit is not None and new:
        if hint is not _NO_HINT:
            accepted = np.asarray(admit(new, parents, hints=[hint] * len(new)))
        else:
            accepted = np.asarray(admit(new, parents), dtype=bool)
        take = len(new) if accepted.all() else int(np.argmin(accepted))
        tally["rejected_blocks"] += len(new) - take
        new, parents = new[:take], parents[:take]
    new, parents = new[: max(0, capacity - hits)], parents[: max(0, capacity - hits)]
    shortfall = len(cache) + len(new) - capacity
    if shortfall > 0:
        victims = cache.evict(shortfall, _any, frozenset(keys[:hits]))
        assert victims is not None, "everything but the request's own blocks is evictable"
        tally["evicted_blocks"] += len(victims)
    if new:
        cache.insert(new, parents)
        tally["stored_blocks"] += len(new)


def _any(key: bytes) -> bool:
    return True


def _accepted(policy: str, options: dict[str, Any]) -> dict[str, Any]:
    """Drop ``clock`` for policies whose constructor does not take it."""
    import inspect

    from kvmgr.policy import POLICIES

    factory = POLICIES.get(policy)
    if factory is None or "clock" in inspect.signature(factory).parameters:
        return options
    return {k: v for k, v in options.items() if k != "clock"}
