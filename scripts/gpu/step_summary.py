"""Summary of ``kvmgr bench swap`` step tables written as ``DIR/step_<tree>_<run>.json``.

    python3 scripts/gpu/step_summary.py DIR

Used by ``scripts/gpu/stepcost.sh`` and ``stepplan.sh``. Prints, per (engine, ids, tree), the
median over runs of the ``step()`` host, manager, plan, engine and issue us, then for each case
run by both trees new / old of host, manager and engine, with the case's target.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

KEYS = ("host_us", "manager_us", "plan_us", "engine_us", "issue_us")


def load(folder: str) -> dict[tuple[str, str, str], list[dict]]:
    """Step rows by (engine, ids, tree) from every ``step_<tree>_<run>.json`` in ``folder``."""
    rows: dict[tuple[str, str, str], list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "step_*_*.json"))):
        tree = os.path.basename(path).split("_")[1]
        try:
            step = json.loads(Path(path).read_text()).get("step", [])
        except ValueError:
            continue
        for row in step:
            if "host_us" in row:
                rows.setdefault((row["engine"], row["ids"], tree), []).append(row)
    return rows


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(folder: str) -> None:
    rows = load(folder)
    print("step() host us, median of runs: engine ids tree | " + " ".join(k[:-3] for k in KEYS))
    for key in sorted(rows):
        print(" ".join(key), "|", " ".join(f"{median(rows[key], k):7.0f}" for k in KEYS))
    pairs = (("new", "old"),)
    for (engine, ids), (b, a) in itertools.product(sorted({key[:2] for key in rows}), pairs):
        old, new = rows.get((engine, ids, a)), rows.get((engine, ids, b))
        if not (old and new):
            continue
        parts = []
        for k in ("host_us", "manager_us", "engine_us"):
            o, n = median(old, k), median(new, k)
            parts.append(f"{k[:-3]} {n:.0f} / {o:.0f} us ({n / o:.2f}x)")
        print(
            f"{engine} {ids}: {b} / {a} "
            + ", ".join(parts)
            + f"; target {new[0].get('target_us')} us"
        )


if __name__ == "__main__":
    main(sys.argv[1])
