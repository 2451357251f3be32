"""Randomized stress of an ``OffloadManager``: every operation, injected failures, every page
checked.

Offers:
    run_stress     drive managers with ``num_ops`` seeded random operations; a ``StressReport``
    StressReport   what a run did: operations, steps, pages compared, outcomes, seconds
    StressFailure  the ``AssertionError`` raised on wrong bytes, a broken invariant, an untyped
                   error, a refused call that changed state, or a future that never resolved

A run is a sequence of episodes. Each builds a manager with a random configuration (GPU and
CPU tier sizes, policy, ``flush``, ``backpressure``, ``merge``) on a ``FaultyEngine`` that
holds every batch until the run lets the oldest ones go (some failed on purpose, a few refused
at submit, a random share failed at ``fail_rate``), under a ``VirtualClock`` (store deadlines
expire when the run advances time). Operations, drawn from one ``random.Random(seed)``:
``allocate`` (new requests whose cached prefix is loaded with ``swap_in``/``load_many`` and
the rest written), ``swap_out``/``store_many`` of prompt chains, ``preempt``, ``resume``,
``free`` (also of requests with copies in flight), cancellation of any unresolved future,
``invalidate``/``clear``/``touch``/``lookup``, misuse (a key cycle, ids not held, unknown keys
or requests: each must raise a kvmgr error and change nothing), ``step()``, letting batches
complete, advancing time. After every ``step()``: ``check_invariants``, the pages of every
READY key against the bytes its key names, and every GPU block a request holds whose content
is known.

Command line (several processes, seeds ``seed .. seed + processes - 1``)::

    python -m kvmgr.testing.stress --ops 1000000 --processes 2 --seed 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence

import attrs
import torch

from kvmgr.testing._stress_run import NUM_KEYS, PAGES, Episode, StressFailure

__all__ = ["StressFailure", "StressReport", "run_stress"]

#: operation -> weight of its draw
WEIGHTS: Mapping[str, int] = {
    "new": 14, "store": 16, "recompute": 4, "preempt": 5, "resume": 5, "free": 8,
    "cancel": 3, "keys": 6, "misuse": 1, "complete": 18, "step": 14, "time": 2,
}  # fmt: skip


@attrs.frozen(kw_only=True)
class StressReport:
    """What a stress run did.

    Attributes:
        seed: the seed of its ``random.Random``.
        ops: operations driven (misuse and no-op draws included).
        episodes: managers built and closed.
        steps: ``step()`` calls, each followed by the full check.
        page_checks: pages compared with the bytes they must hold (CPU tier + GPU blocks).
        seconds: wall-clock seconds.
        counts: operation outcomes (``"store.ok"``, ``"load.TransferError"``,
            ``"refused.allocate.PoolExhaustedError"``, ``"misuse.InvalidKeyError"``, ...).
    """

    seed: int
    ops: int
    episodes: int
    steps: int
    page_checks: int
    seconds: float
    counts: Mapping[str, int]

    def __add__(self, other: StressReport) -> StressReport:
        return StressReport(
            seed=min(self.seed, other.seed),
            ops=self.ops + other.ops,
            episodes=self.episodes + other.episodes,
            steps=self.steps + other.steps,
            page_checks=self.page_checks + other.page_checks,
            seconds=max(self.seconds, other.seconds),
            counts=dict(Counter(self.counts) + Counter(other.counts)),
        )


def _content(seed: int) -> list[torch.Tensor]:
    """Per tensor, uint8 ``[NUM_KEYS, page_bytes]``: the bytes key ``k`` names (no zeros)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 255, (NUM_KEYS, p), dtype=torch.uint8, generator=gen) for p in PAGES]


async def _episode(ep: Episode, num_ops: int, names: list[str], weights: list[int]) -> int:
    rng, loop = ep.rng, asyncio.get_running_loop()
    steps = 0
    with ep.clock.install(loop):
        await ep.mgr.__aenter__()
        for i in range(num_ops):
            ep.op_index = i
            name = rng.choices(names, weights)[0]
            ep.counts[f"op.{name}"] += 1
            ep.log.append(name)
            result = getattr(ep, f"op_{name}")()
            if asyncio.iscoroutine(result):
                await result
            steps += name == "step"
        ep.engine.release()  # drain: every batch runs, waiting stores expire
        ep.clock.advance(3600.0)
        for _ in range(3):
            await asyncio.sleep(0)
    for _ in range(400):  # up to ~20 s: every future resolved, every batch (cancelled
        await ep.mgr.step()  # futures' ones too) settled
        pending = [f for f in ep.futures if not f.done()]
        stats = ep.mgr.statistics()
        if not (pending or stats.batches_in_flight or stats.queued_swaps or stats.stores_waiting):
            break
        await asyncio.wait(pending or [asyncio.ensure_future(asyncio.sleep(0.05))], timeout=0.05)
    else:
        raise StressFailure(f"not quiescent 20 s after the drain: {len(pending)} futures, {stats}")
    ep.check()
    await ep.mgr.aclose(timeout_s=10.0)
    if ep.counts["untyped"]:
        raise StressFailure("a future failed with an untyped error: " + "; ".join(ep.log))
    return steps


async def run_stress(
    num_ops: int, *, seed: int = 0, episode_ops: int = 2000, weights: Mapping[str, int] = WEIGHTS
) -> StressReport:
    """Drive managers with ``num_ops`` random operations (see the module docstring).

    Args:
        num_ops: operations in all (>= 1), split into episodes of ``episode_ops``.
        seed: seed of the run's ``random.Random`` (configurations, operations, contents).
        episode_ops: operations per manager before it is drained, checked and closed.
        weights: operation -> draw weight (default ``WEIGHTS``).

    Raises:
        StressFailure: a finding; the message names the seed, the operation count and the last
            operations.
        ValueError: ``num_ops`` or ``episode_ops`` < 1, or an unknown operation in ``weights``.
    """
    _check_args(num_ops, episode_ops, weights)
    rng, counts, content = random.Random(seed), Counter[str](), _content(seed)
    names, draw = list(weights), list(weights.values())
    start, done, steps, pages, episodes = time.perf_counter(), 0, 0, 0, 0
    while done < num_ops:
        n = min(episode_ops, num_ops - done)
        ep = Episode(rng, content, counts)
        try:
            steps += await _episode(ep, n, names, draw)
        except StressFailure as exc:
            raise StressFailure(f"seed {seed}, op {done + ep.op_index}: {exc}; last ops: "
                                f"{list(ep.log)}") from exc  # fmt: skip
        except Exception as exc:
            raise StressFailure(f"seed {seed}, episode {episodes}: {type(exc).__name__}: {exc}; "
                                f"last ops: {list(ep.log)}") from exc  # fmt: skip
        finally:
            ep.engine.release()
            ep.mgr.close(5.0)
        done, pages, episodes = done + n, pages + ep.page_checks, episodes + 1
    return StressReport(
        seed=seed, ops=done, episodes=episodes, steps=steps, page_checks=pages,
        seconds=time.perf_counter() - start, counts=dict(counts),
    )  # fmt: skip


def _check_args(num_ops: int, episode_ops: int, weights: Mapping[str, int]) -> None:
    if num_ops < 1 or episode_ops < 1:
        raise ValueError(f"expected num_ops, episode_ops >= 1, got {num_ops}, {episode_ops}")
    unknown = set(weights) - set(WEIGHTS)
    if unknown:
        raise ValueError(f"unknown operations {sorted(unknown)}; known: {sorted(WEIGHTS)}")


def _worker(args: tuple[int, int, int]) -> StressReport:
    num_ops, seed, episode_ops = args
    torch.set_num_threads(1)
    return asyncio.run(run_stress(num_ops, seed=seed, episode_ops=episode_ops))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvmgr.testing.stress``: run, print the report as JSON; 1 on a finding."""
    parser = argparse.ArgumentParser(prog="python -m kvmgr.testing.stress", description=__doc__)
    parser.add_argument("--ops", type=int, default=100_000, help="operations in all")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first process")
    parser.add_argument("--processes", type=int, default=1, help="processes (seeds seed+i)")
    parser.add_argument("--episode-ops", type=int, default=2000, help="operations per manager")
    args = parser.parse_args(argv)
    if args.ops < 1 or args.processes < 1 or args.episode_ops < 1:
        parser.error("--ops, --processes and --episode-ops must be >= 1")
    share = [args.ops // args.processes + (i < args.ops % args.processes)
             for i in range(args.processes)]  # fmt: skip
    jobs = [(n, args.seed + i, args.episode_ops) for i, n in enumerate(share) if n]
    start = time.perf_counter()
    try:
        if len(jobs) == 1:
            reports = [_worker(jobs[0])]
        else:
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(len(jobs)) as pool:
                reports = list(pool.map(_worker, jobs))
    except StressFailure as exc:
        print(f"stress: FINDING: {exc}", file=sys.stderr)
        return 1
    total = reports[0]
    for report in reports[1:]:
        total = total + report
    out = attrs.asdict(total)
    out["seconds"] = round(time.perf_counter() - start, 1)
    out["seeds"] = [job[1] for job in jobs]
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
