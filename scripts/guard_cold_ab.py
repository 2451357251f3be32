"""The moved-tensor check (``kvmgr.worker._guard_c.same_check``) of an old tree against this
one, cold, in ONE process (issue 27, helper ``hostpath14``).

    python3 scripts/guard_cold_ab.py [--old REV] [--flush-mib 16] [--pairs 3000]

The old tree's ``kvmgr`` is unpacked as ``kvmgr_old`` (``scripts/step_cost_ab.py``'s
``unpack_old``: ``build/bases/REV/kvmgr`` where carried, else ``git archive``). Both checks are
built over the same 48 CPU tensors of 1025 x 4096 bytes (allocated among other objects, as a
manager's are); each pair writes ``--flush-mib`` MiB of a numpy buffer before each call (the
caches as a step finds them after the calls), then times one call of each tree's check, the
first of each pair alternating. Prints min / p10 / median us per tree and the median of the
per-pair ratios new / old.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import step_cost_ab  # scripts/: this script's folder
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", default=None, help="old revision (default: merge-base HEAD main)")
    parser.add_argument("--flush-mib", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=3000)
    args = parser.parse_args()
    rev = step_cost_ab.old_revision(args.old)
    sys.path.insert(0, str(step_cost_ab.ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        step_cost_ab.unpack_old(rev, Path(tmp))
        sys.path.insert(0, tmp)
        old = importlib.import_module("kvmgr_old.worker._guard_c")
        new = importlib.import_module("kvmgr.worker._guard_c")
        others, tensors = [], []
        for _ in range(48):
            tensors.append(torch.empty((1025, 4096), dtype=torch.uint8))
            others.append([object() for _ in range(300)])
        checks = {"old": old.same_check(tensors), "new": new.same_check(tensors)}
        if any(c is None or not c() for c in checks.values()):
            raise SystemExit("no shim check here (kvmgr's C modules do not build)")
        buf = np.zeros(args.flush_mib << 20, dtype=np.uint8)
        got: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(args.pairs):
            for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
                check = checks[name]
                buf += 1
                t0 = time.perf_counter_ns()
                same = check()
                got[name].append((time.perf_counter_ns() - t0) / 1e3)
                assert same
    print(
        f"old = {rev[:10]}, new = this tree; {args.pairs} pairs, {args.flush_mib} MiB written before each call; us"
    )
    for name, values in got.items():
        s = sorted(values)
        print(f"{name}: min {s[0]:.2f} p10 {s[len(s) // 10]:.2f} median {statistics.median(s):.2f}")
    ratio = statistics.median(b / a for a, b in zip(got["old"], got["new"]))
    print(f"new / old, median of the per-pair ratios: {ratio:.3f}")


if __name__ == "__main__":
    main()
