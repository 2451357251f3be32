"""``add_absent`` (``kvmgr._index_c``) of an old tree against this one, in ONE process (issue 27,
helper hostpath15).

    python3 scripts/add_absent_ab.py [--old TREE] [--keys 100000] [--flush-mib 16] [--calls 400]

Both trees' C sources are built (renamed ``kvmgr_index_old`` / ``kvmgr_index_new``); each gets
its own dict of ``--keys`` 8-byte keys (``kvmgr bench host``'s ``FreshKeys``), and every call
puts the same 512 fresh keys into both, alternating which goes first, with ``--flush-mib`` of
memory written before each call (the caches as a step leaves them). Printed: min / p10 / median
us per tree and new / old; the two dicts must end equal (entries and order). ``--old`` is a
folder holding ``kvmgr/`` (default: this tree, i.e. a noise run).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch  # noqa: F401  (kvmgr's builder needs torch loaded)

ROOT = Path(__file__).resolve().parents[1]


def source(tree: Path, name: str) -> str:
    text = (tree / "kvmgr" / "_index_c.py").read_text()
    body = re.search(r'_SOURCE = r"""(.*?)"""', text, re.S)
    assert body is not None, tree
    return body.group(1).replace("kvmgr_index", name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", default=str(ROOT))
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--flush-mib", type=int, default=16)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from kvmgr._native import build

    mods = {t: build(source(Path(p), f"kvmgr_index_{t}"), f"kvmgr_index_{t}")
            for t, p in (("old", args.old), ("new", ROOT))}  # fmt: skip
    if not all(mods.values()):
        sys.exit("the C module does not build here")
    flush = np.zeros(args.flush_mib << 20, np.uint8)
    dicts = {t: {i.to_bytes(8, "little"): i for i in range(args.keys)} for t in mods}
    values, times = list(range(512)), {t: [] for t in mods}
    for r in range(args.calls + 20):
        start = args.keys + 512 * r
        keys = [i.to_bytes(8, "little") for i in range(start, start + 512)]
        for tree in ("old", "new") if r % 2 else ("new", "old"):
            flush += 1
            batch = list(keys)
            t0 = time.perf_counter_ns()
            added = mods[tree].add_absent(dicts[tree], batch, values)
            if r >= 20:
                times[tree].append((time.perf_counter_ns() - t0) / 1e3)
            assert added == 512
    assert list(dicts["old"].items()) == list(dicts["new"].items())
    stats = {}
    for tree, v in times.items():
        v.sort()
        stats[tree] = (v[0], v[len(v) // 10], statistics.median(v))
        print(f"{tree}: min {v[0]:.1f} p10 {stats[tree][1]:.1f} median {stats[tree][2]:.1f} us")
    ratio = [n / o for n, o in zip(stats["new"], stats["old"])]
    print(f"add_absent {args.keys} keys + 512 x {args.calls}, {args.flush_mib} MiB flushed; "
          f"new / old min {ratio[0]:.3f} p10 {ratio[1]:.3f} median {ratio[2]:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
