"""``kvmgr bench policy``: host cost of each eviction/admission policy per 512-block step.

Replays the first ``--requests`` requests of the bundled Mooncake trace at the simulator's
block size (64 tokens: eight keys per trace block) through each policy the way the manager
drives it (``touch`` of the leading hits, ``admit`` when the policy has it, ``evict`` of the
shortfall, ``insert``), with the CPU tier at ``--cpu-tokens``. Only the policy calls are timed,
in CPU time of this process (``time.process_time`` around each, so that other load on a shared
machine does not count; its resolution is about 1 us on Linux); reported: microseconds of policy time per 512 keys seen
(hits + stores), and the ratio to LRU in the same process. ``opt`` is left out (it needs the
future and is simulator-only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from kvmgr.bench._options import positive_int
from kvmgr.policy import make_policy
from kvmgr.sim.keys import BlockKeyer
from kvmgr.sim.trace import default_trace_path, load_trace

__all__ = ["add_arguments", "run"]

_POLICIES = ("lru", "arc", "s3fifo", "reuse", "online")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvmgr bench policy``."""
    parser.add_argument("--requests", type=int, default=3000, help="trace requests replayed")
    parser.add_argument("--cpu-tokens", type=int, default=3_000_000, help="CPU tier tokens")
    parser.add_argument("--block-size", type=positive_int, default=64, help="tokens per block")
    parser.add_argument("--policies", default=",".join(_POLICIES), help="policies to time")
    parser.add_argument("--json", default=None, help="also write the results to this file")


def _time_policy(
    name: str, all_keys: list[list[bytes]], arrivals: list[float], capacity: int
) -> float:
    now = [0.0]
    options: dict[str, Any] = {"clock": lambda: now[0]} if name in ("reuse", "online") else {}
    policy = make_policy(name, capacity, **options)
    admit = getattr(policy, "admit", None)
    spent, seen, clock = 0.0, 0, time.process_time
    for keys, t in zip(all_keys, arrivals):
        now[0] = t
        hits = 0
        for key in keys:  # the lookup (the manager's index, not the policy)
            if key not in policy:
                break
            hits += 1
        new = keys[hits:]
        parents = [keys[hits - 1] if hits else None, *new[:-1]][: len(new)]
        start = clock()
        if hits:
            policy.touch(keys[:hits])
        if admit is not None and new:
            mask = np.asarray(admit(new, parents), dtype=bool)
            take = len(new) if mask.all() else int(np.argmin(mask))
            new, parents = new[:take], parents[:take]
        new, parents = new[: max(0, capacity - hits)], parents[: max(0, capacity - hits)]
        short = len(policy) + len(new) - capacity
        if short > 0:
            policy.evict(short, _any, frozenset(keys[:hits]))
        if new:
            policy.insert(new, parents)
        spent += clock() - start
        seen += len(keys)
    return spent / seen * 512 * 1e6


def _any(key: bytes) -> bool:
    return True


def run(args: argparse.Namespace) -> int:
    """Time the policies; prints a table (and writes ``--json``); exit status 0, 2 on bad input."""
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not names or args.requests < 1 or args.cpu_tokens < args.block_size:
        print("kvmgr bench policy: error: bad --policies/--requests/--cpu-tokens", file=sys.stderr)
        return 2
    trace = load_trace(default_trace_path(), limit=args.requests)
    keyer = BlockKeyer(args.block_size)
    all_keys = [keyer.prefix_keys(r) for r in trace]
    arrivals = [r.arrival_s for r in trace]
    capacity = args.cpu_tokens // args.block_size
    rows = {name: _time_policy(name, all_keys, arrivals, capacity) for name in names}
    base = rows.get("lru")
    print(f"policy host time per 512 keys ({args.requests} requests, {capacity} CPU blocks)")
    for name, us in rows.items():
        ratio = "" if base is None else f"  x{us / base:.2f} of lru"
        print(f"  {name:8s} {us:8.1f} us{ratio}")
    if args.json:
        data = {"requests": args.requests, "cpu_blocks": capacity, "us_per_512_keys": rows}
        with open(args.json, "w") as handle:
            json.dump(data, handle, indent=2)
    return 0
