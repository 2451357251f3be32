"""Issue 27's host-path rows for an old tree against this one, alternating runs, no GPU.

    git archive main kvmgr | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    python3 scripts/host_ab.py /tmp/old [--new TREE] [--runs 2] [--rounds 100] [--steps 1000]
        [--vllm-steps 60] [--json PATH]

Each tree runs in a process of its own (``sys.path`` puts the tree first), the trees take turns
``--runs`` times, so load from other processes falls on both alike. A run measures, with the
garbage collector on and ``kvmgr.testing.NullEngine`` (no copy):

- ``kvmgr bench host``'s 512 one-block stores, per-call and batched: p50 of the round (calls +
  ``step()`` + completion) and of ``step()`` alone (512 queued 48-tensor stores, the manager's
  share of the step; the engine's share needs the GPU, ``scripts/gpu/hostpath.sh``);
- its steady state (``--steps`` rounds into a full CPU tier): round p50/p99 and full (generation
  2) collections;
- ``kvmgr bench vllm`` (needs vLLM 0.33): p50 per step of kvmgr and of vLLM's
  ``CPUOffloadingManager`` on the same calls, LRU and ARC, and their ratio.

Printed: per row the median over runs of each tree's figure and new / old; for ``bench vllm``
also kvmgr / vLLM per tree (vLLM's side is the same code in both, measured in each run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

_CHILD = r"""
import asyncio, json, sys
src, out, rounds, steps, vsteps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
sys.path.insert(0, src)
import kvmgr
assert kvmgr.__file__.startswith(src), kvmgr.__file__
from kvmgr.bench import host
doc = {"host": [asyncio.run(host._variant("store", api, 512, 1, rounds))
                for api in ("per-call", "batched")],
       "steady": [asyncio.run(host._steady(api, steps)) for api in ("per-call", "batched")]}
if vsteps:
    from kvmgr.bench import vllm
    doc["vllm"] = vllm.measure(vsteps)
with open(out, "w") as f:
    json.dump(doc, f)
"""


def _run(tree: Path, rounds: int, steps: int, vsteps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run(
            [sys.executable, "-c", _CHILD, str(tree), out, str(rounds), str(steps), str(vsteps)],
            check=True,
            env=env,
            cwd=tmp,
        )
        with open(out) as f:
            return json.load(f)


def _rows(doc: dict) -> dict[str, float]:
    """Flat ``name -> value`` of one run."""
    rows: dict[str, float] = {}
    for r in doc["host"]:
        rows[f"host {r['api']} round p50 us"] = r["round_us_p50"]
        rows[f"host {r['api']} step() p50 us"] = r["step_us_p50"]
    for s in doc["steady"]:
        rows[f"steady {s['api']} round p50 us"] = s["round_us_p50"]
        rows[f"steady {s['api']} round p99 us"] = s["round_us_p99"]
        rows[f"steady {s['api']} full GCs"] = s["full_collections"]
    for v in doc.get("vllm", []):
        name = f"vllm {v['policy']} {v['scenario']} {v['api']}"
        rows[f"{name} kvmgr p50 us"] = v["kvmgr_p50_us"]
        rows[f"{name} vLLM p50 us"] = v["vllm_p50_us"]
        rows[f"{name} kvmgr/vLLM"] = v["ratio"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("old", type=Path, help="a tree holding the old kvmgr/ package")
    parser.add_argument("--new", type=Path, default=HERE, help="the new tree (default: this one)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--vllm-steps", type=int, default=60, help="0 skips bench vllm")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for i in range(args.runs):
        for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
            doc = _run(trees[name], args.rounds, args.steps, args.vllm_steps)
            runs[name].append(_rows(doc))
            print(f"run {i + 1}/{args.runs} {name} done", file=sys.stderr, flush=True)
    table = {}
    print("| row | old | new | new / old |\n|---|---|---|---|")
    for row in runs["new"][0]:
        old = statistics.median(r[row] for r in runs["old"])
        new = statistics.median(r[row] for r in runs["new"])
        ratio = new / old if old else float("nan")
        table[row] = {"old": old, "new": new, "new_over_old": ratio}
        print(f"| {row} | {old:.2f} | {new:.2f} | {ratio:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": args.runs, "rows": table, "raw": runs}, f, indent=1)


if __name__ == "__main__":
    main()
