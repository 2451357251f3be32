"""Host cost of a layerwise load / store against a whole-prefix one, old tree vs this one.

    git archive <old commit> kvmgr | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    python3 scripts/layerwise_host_ab.py /tmp/old [--runs 3] [--rounds 300]

Each tree runs in its own process (``--child``), old and new alternating, ``--runs`` times.
A child drives an ``OffloadManager`` over 64 CPU "KV tensors" (32 layers x K and V, the
Llama-3-8B layer count) with ``kvmgr.testing.NullEngine`` (every batch completes in ``submit``,
nothing is copied), so what is timed is kvmgr's Python: one *step* is

- ``layerwise load``: ``load_layerwise(keys, ids, layers=2, max_groups=G)``, ``wait_layer(i)``
  for every layer, ``step()``, ``await``;
- ``layerwise store``: ``store_layerwise(ids, keys, layers=2, max_groups=G)``, ``save_layer(i)``
  for every layer, ``step()``, ``await`` (new keys each step, invalidated after it, untimed,
  so no step evicts);
- ``whole load`` / ``whole store``: ``load_many`` / ``store_many`` + ``step()`` + ``await``.

of ``--blocks`` blocks (96: the example engine's hit probe). Reported: the minimum over runs of
each tree's median us per step, the extra us per group over the whole-prefix step of the same
tree (``(layerwise - whole) / G``) and new / old. On the GPU the engine's own submit (events,
driver calls: ~20-40 us a batch on the H200 host) comes on top, per group.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
LAYERS = 32


async def _child(rounds: int, blocks: int, groups: list[int]) -> dict[str, float]:
    import torch

    from kvmgr import ManagerConfig, OffloadManager
    from kvmgr.testing import NullEngine

    kv = [torch.zeros(4 * blocks, 64, dtype=torch.uint8) for _ in range(2 * LAYERS)]
    config = ManagerConfig(num_cpu_blocks=64 * blocks)
    out: dict[str, float] = {}
    async with OffloadManager(kv, config, engine=NullEngine()) as mgr:
        counter = iter(range(1 << 40))

        def fresh() -> list[bytes]:
            return [next(counter).to_bytes(8, "little") for _ in range(blocks)]

        keys = fresh()
        src = mgr.allocate("a", blocks)
        stored = mgr.store_many(src, keys)
        await mgr.step()
        await stored
        dst = mgr.allocate("b", blocks)

        async def whole_load(g: int) -> None:  # (returns nothing to drop)
            future = mgr.load_many(keys, dst)
            await mgr.step()
            await future

        async def whole_store(g: int) -> list[bytes]:
            stored = fresh()
            future = mgr.store_many(src, stored)
            await mgr.step()
            await future
            return stored

        async def layer_load(g: int) -> None:
            load = mgr.load_layerwise(keys, dst, layers=2, max_groups=g)
            for layer in range(LAYERS):
                load.wait_layer(layer)
            await mgr.step()
            await load

        async def layer_store(g: int) -> list[bytes]:
            stored = fresh()
            store = mgr.store_layerwise(src, stored, layers=2, max_groups=g)
            for layer in range(LAYERS):
                store.save_layer(layer)
            await mgr.step()
            await store
            return stored

        # the loads first: the stores' fresh keys evict the loaded ones from the CPU tier
        cases = [("whole load", whole_load, 1)]
        cases += [(f"layerwise load G={g}", layer_load, g) for g in groups]
        cases += [("whole store", whole_store, 1)]
        cases += [(f"layerwise store G={g}", layer_store, g) for g in groups]
        for name, fn, g in cases:
            times = []
            for i in range(20 + rounds):
                start = time.perf_counter()
                stored = await fn(g)
                if i >= 20:  # 20 warm-up steps
                    times.append(time.perf_counter() - start)
                if stored:  # untimed: drop the stored keys (no eviction in the timed steps)
                    mgr.invalidate(stored)
            out[name] = 1e6 * statistics.median(times)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, nargs="?", help="root of the old tree (holding kvmgr/)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=96)
    parser.add_argument("--groups", default="8,32", help="comma-separated max_groups values")
    parser.add_argument("--child", action="store_true", help="measure this tree, print JSON")
    args = parser.parse_args()
    groups = [int(g) for g in args.groups.split(",")]
    if args.child:
        print(json.dumps(asyncio.run(_child(args.rounds, args.blocks, groups))))
        return 0
    trees = {"new": HERE} | ({"old": args.old} if args.old else {})
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.runs):
        for label in sorted(trees, reverse=True):  # new, then old
            env = dict(os.environ, PYTHONPATH=str(trees[label]))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--rounds",
                   str(args.rounds), "--blocks", str(args.blocks), "--groups", args.groups]  # fmt: skip
            row = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True,
                                            text=True).stdout)  # fmt: skip
            mine = best.setdefault(label, {})
            for k, v in row.items():
                mine[k] = min(mine.get(k, v), v)
    print(f"us per step (min over {args.runs} runs of the median of {args.rounds}), "
          f"{args.blocks} blocks, {LAYERS} layers, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    header = "| case | " + " | ".join(f"{t} us/step | {t} extra us/group" for t in best)
    print(header + (" | new / old |" if "old" in best else " |"))
    print("|---" * (1 + 2 * len(best) + ("old" in best)) + "|")
    for name in best["new"]:
        cells = []
        for label in best:
            value = best[label][name]
            g = int(name.split("G=")[1]) if "G=" in name else 0
            base = best[label]["whole load" if "load" in name else "whole store"]
            extra = f"{(value - base) / g:.1f}" if g else "-"
            cells += [f"{value:.0f}", extra]
        ratio = f" | {best['new'][name] / best['old'][name]:.2f}x" if "old" in best else ""
        print(f"| {name} | " + " | ".join(cells) + ratio + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
