"""``kvmgr bench host`` of an old tree vs this one (the scheduler/worker split), alternately.

    git archive c1e724d kvmgr | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    python3 scripts/split_host_ab.py /tmp/old [--runs 3] [--rounds 100] [--steps 300]

Each tree runs ``kvmgr bench host --json`` in its own process, old and new alternating,
``--runs`` times. A row is the minimum over runs of each tree's per-round minimum (and median)
in microseconds, and the ratio new / old: the figure least inflated by a shared machine.
Prints a markdown table; ``--json`` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _one(tree: Path, rounds: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "host.json"
        env = dict(os.environ, PYTHONPATH=str(tree))
        cmd = [sys.executable, "-m", "kvmgr.cli", "bench", "host", "--rounds", str(rounds)]
        cmd += ["--steps", str(steps), "--json", str(out)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="root of the old tree (holding kvmgr/)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    best: dict[str, dict[str, dict[str, float]]] = {"old": {}, "new": {}}
    for _ in range(args.runs):
        for name, tree in (("old", args.old), ("new", HERE)):
            doc = _one(tree, args.rounds, args.steps)
            rows = [
                (f"{r['kind']} {r['requests']}x{r['blocks_per_request']} {r['api']}", r)
                for r in doc["scenarios"]
            ] + [(f"steady 512x1 {s['api']}", s) for s in doc["steady"]]
            for label, r in rows:
                cur = best[name].setdefault(label, {"min": float("inf"), "p50": float("inf")})
                cur["min"] = min(cur["min"], r.get("round_us_min", r["round_us_p50"]))
                cur["p50"] = min(cur["p50"], r["round_us_p50"])
    lines = [
        "| scenario | old min / p50 us | new min / p50 us | new/old min | new/old p50 |",
        "|---|---|---|---|---|",
    ]
    rows = []
    for label, old in best["old"].items():
        new = best["new"][label]
        rows.append({"scenario": label, "old": old, "new": new})
        lines.append(
            f"| {label} | {old['min']:.0f} / {old['p50']:.0f} | {new['min']:.0f} / "
            f"{new['p50']:.0f} | {new['min'] / old['min']:.3f} | {new['p50'] / old['p50']:.3f} |"
        )
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
