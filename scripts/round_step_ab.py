"""The batched round's step and completion of an old kvmgr tree against this one, in ONE process.

    python3 scripts/round_step_ab.py [--old REV] [--rounds 600] [--modes grow full] [--json PATH]

Issue 27 (helper ``stepfast``). ``scripts/host_pair.py`` times whole rounds in two processes;
the calls (``store_many``) are most of a round, so a change of the step's few microseconds is
lost in their noise on a shared machine. Here both trees run in one process, as in
``scripts/step_cost_ab.py`` (``git archive REV kvmgr`` unpacked as ``kvmgr_old``), one round of
each in turn, the first alternating: ``store_many`` of 512 fresh one-block keys over 48 CPU
tensors with ``NullEngine`` (``kvmgr bench host``'s batched round), then ``step()`` and the
store's completion. Modes ``grow`` (the CPU tier has room: no eviction) and ``full`` (4 x 512
CPU blocks: every round evicts 512 keys).

Printed per mode and tree (us; min / p10 / median): ``calls`` (``store_many``), ``host``
(``StepReport.host_s``: the flush), ``step`` (from the end of the calls to the awaited store:
the flush, the loop turn and the completion) and ``round``; then new / old of each.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from step_cost_ab import _stats, old_revision, unpack_old  # scripts/: this script's folder

ROOT = Path(__file__).resolve().parents[1]
N = 512
WHAT = ("calls", "host", "step", "round")


class Rig:
    """One tree's manager over 48 CPU tensors with ``NullEngine``."""

    def __init__(self, package: str, mode: str, rounds: int) -> None:
        host = importlib.import_module(package + ".bench.host")
        keys = importlib.import_module(package + ".bench._keys")
        cpu = (rounds + 40) * N if mode == "grow" else 4 * N
        self.mgr, self._kv = host._manager(2 * N, cpu)
        self.fresh = keys.FreshKeys()
        self.samples: dict[str, list[float]] = {w: [] for w in WHAT}

    async def start(self) -> None:
        await self.mgr.__aenter__()
        self.ids = np.array(self.mgr.allocate("bench", 2 * N), dtype=np.int64)

    async def round(self, keep: bool) -> None:
        keys = self.fresh.take(N)
        t0 = time.perf_counter()
        last = self.mgr.store_many(self.ids[:N], keys)
        t1 = time.perf_counter()
        report = await self.mgr.step()
        await last
        t2 = time.perf_counter()
        if keep:
            for what, value in zip(WHAT, (t1 - t0, report.host_s, t2 - t1, t2 - t0)):
                self.samples[what].append(value * 1e6)


async def run_mode(mode: str, rounds: int) -> dict[str, Any]:
    """Both trees' figures for one mode, rounds interleaved (20 warm-up rounds each)."""
    rigs = {"old": Rig("kvmgr_old", mode, rounds), "new": Rig("kvmgr", mode, rounds)}
    for rig in rigs.values():
        await rig.start()
    try:
        for r in range(rounds + 20):
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                await rigs[name].round(keep=r >= 20)
    finally:
        for rig in rigs.values():
            await rig.mgr.__aexit__(None, None, None)
    row: dict[str, Any] = {"mode": mode}
    for what in WHAT:
        old, new = (_stats(rigs[n].samples[what]) for n in ("old", "new"))
        row[what] = {"old": old, "new": new, "ratio": {k: new[k] / old[k] for k in old}}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", default=None, help="old revision (default: merge-base HEAD main)")
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--modes", nargs="+", default=["grow", "full"], choices=["grow", "full"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # this tree's kvmgr, then the old one as kvmgr_old
    rows, rev = [], old_revision(args.old)
    with tempfile.TemporaryDirectory() as tmp:
        unpack_old(rev, Path(tmp))
        sys.path.insert(0, tmp)
        for mode in args.modes:
            rows.append(asyncio.run(run_mode(mode, args.rounds)))
    print(f"old = {rev[:10]}, new = this tree; {args.rounds} rounds each, interleaved; us")
    print(
        "| mode | figure | old min / p10 / median | new min / p10 / median | new / old p10, median |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        for what in WHAT:
            cell = row[what]
            trees = [" / ".join(f"{cell[t][k]:.1f}" for k in ("min", "p10", "median")) for t in ("old", "new")]  # fmt: skip
            ratio = cell["ratio"]
            print(f"| {row['mode']} | {what} | {trees[0]} | {trees[1]} | "
                  f"{ratio['p10']:.3f}, {ratio['median']:.3f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"old": rev, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
