"""Batched host rounds of two trees, paired round by round, no GPU (issue 27).

    git archive main kvmgr | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    python3 scripts/host_pair.py /tmp/old [--new TREE] [--rounds 300] [--json PATH]

Two processes stay up (each puts its tree first on ``sys.path``) and take turns one round at a
time, the first of each pair alternating, so load from other processes on a shared machine falls
on both alike; ``scripts/host_ab.py`` runs whole benchmarks in turn instead, which needs a quiet
machine. A round is ``kvmgr bench host``'s batched store: one ``store_many`` of 512 one-block
keys, ``step()`` and its completion, over 48 tensors with ``kvmgr.testing.NullEngine`` (no copy),
the garbage collector on. Two modes: ``grow`` (the CPU tier has room for every round: no
eviction) and ``full`` (4 x 512 CPU blocks: every round evicts 512 keys through the LRU policy);
``grow-call`` and ``full-call`` store the same keys through 512 ``swap_out`` calls of one block;
``load`` and ``load-call`` store 512 keys into a full tier (untimed), then time one ``load_many``
of them (or 512 ``swap_in`` calls of one block) + ``step()`` + completion.

Printed per mode: each tree's round p50 and min and its calls p50 (``store_many`` alone), in
microseconds, and the median of the per-pair ratios new / old.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

_CHILD = r"""
import asyncio, json, sys, time
src, rounds = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, src)
import kvmgr
assert kvmgr.__file__.startswith(src), kvmgr.__file__
import numpy as np
from kvmgr.bench import host
from kvmgr.bench._keys import FreshKeys
n, loop, rigs = 512, asyncio.new_event_loop(), {}
async def one(mode):
    mgr, _kv, ids, fresh = rigs[mode]
    keys = fresh.take(n)
    if mode.startswith("load"):  # the keys stored first (untimed), then loaded
        await (mgr.store_many(ids[:n], keys), await mgr.step())[0]
    t0 = time.perf_counter()
    if mode == "load":
        last = mgr.load_many(keys, ids[n:])
    elif mode == "load-call":
        held = ids[n:].tolist()
        last = [mgr.swap_in(keys[i : i + 1], held[i : i + 1]) for i in range(n)][-1]
    elif mode.endswith("-call"):  # one swap_out per key
        held = ids.tolist()
        last = [mgr.swap_out(held[i : i + 1], keys[i : i + 1]) for i in range(n)][-1]
    else:
        last = mgr.store_many(ids[:n], keys)
    t1 = time.perf_counter()
    await mgr.step()
    await last
    return time.perf_counter() - t0, t1 - t0
for line in sys.stdin:
    mode = line.strip()
    if mode not in rigs:
        mgr, kv = host._manager(2 * n, (rounds + 40) * n if mode.startswith("grow") else 4 * n)
        loop.run_until_complete(mgr.__aenter__())
        ids = np.array(mgr.allocate("bench", 2 * n), dtype=np.int64)
        rigs[mode] = (mgr, kv, ids, FreshKeys())
    print(json.dumps([s * 1e6 for s in loop.run_until_complete(one(mode))]), flush=True)
"""

WARMUP = 20


def _pairs(procs: dict[str, subprocess.Popen], mode: str, rounds: int) -> dict[str, list]:
    """(round, calls) microseconds of each tree, ``rounds`` pairs after the warm-up."""
    out: dict[str, list] = {name: [] for name in procs}
    for i in range(rounds + WARMUP):
        for name in list(procs) if i % 2 == 0 else list(procs)[::-1]:
            proc = procs[name]
            proc.stdin.write(mode + "\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
            sample = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
            if i >= WARMUP:
                out[name].append(sample)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("old", type=Path, help="a tree holding the old kvmgr/ package")
    parser.add_argument("--new", type=Path, default=HERE, help="the new tree (default: this one)")
    parser.add_argument("--rounds", type=int, default=300, help="timed pairs per mode")
    parser.add_argument("--modes", nargs="+", default=["grow", "full"],
                        choices=["grow", "full", "grow-call", "full-call", "load", "load-call"])  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tree.resolve()), str(args.rounds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, tree in (("old", args.old), ("new", args.new))
    }
    table = {}
    print("| mode | old round p50 (min) | new round p50 (min) | old / new calls p50 | new / old |")
    print("|---|---|---|---|---|")
    for mode in args.modes:
        got = _pairs(procs, mode, args.rounds)
        old, new = got["old"], got["new"]
        row = {
            f"{name}_{what}_us_{stat}": fn(s[k] for s in got[name])
            for name in ("old", "new")
            for what, k in (("round", 0), ("calls", 1))
            for stat, fn in (("p50", statistics.median), ("min", min))
        }
        row["new_over_old"] = statistics.median(b[0] / a[0] for a, b in zip(old, new))
        table[mode] = row
        print(
            f"| {mode} | {row['old_round_us_p50']:.0f} ({row['old_round_us_min']:.0f}) | "
            f"{row['new_round_us_p50']:.0f} ({row['new_round_us_min']:.0f}) | "
            f"{row['old_calls_us_p50']:.0f} / {row['new_calls_us_p50']:.0f} | "
            f"{row['new_over_old']:.3f} |",
            flush=True,
        )
    for proc in procs.values():
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "modes": table}, f, indent=1)


if __name__ == "__main__":
    main()
