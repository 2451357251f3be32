"""Host cost of the input checks round 4 session 5 changed, an old tree against this one.

    git archive main kvmgr | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    python3 scripts/bad_input_ab.py /tmp/old [--rounds 7] [--number 20000]

Loads the old tree's ``kvmgr/pool/allocator.py`` (``as_id_array``) and
``kvmgr/scheduler/keys.py`` (``check_parents``) by path beside this tree's
``kvmgr.pool.block_ids`` and ``kvmgr.scheduler.keys``, in one process, and times each call
(``timeit``, best of 3 per round), old and new alternating ``--rounds`` times. Printed: the
median over rounds of each variant's ns per call, and new / old.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmgr.pool.block_ids import as_id_array
from kvmgr.scheduler.keys import check_parents


def _load(path: Path, name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="a tree holding the old kvmgr/")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=20000)
    args = parser.parse_args()
    old_ids = _load(args.old / "kvmgr/pool/allocator.py", "old_allocator").as_id_array  # type: ignore[attr-defined]
    old_parents = _load(args.old / "kvmgr/scheduler/keys.py", "old_keys").check_parents  # type: ignore[attr-defined]
    ids_list, ids_tuple = list(range(512)), tuple(range(512))
    ids_i64, ids_u32 = np.arange(512, dtype=np.int64), np.arange(512, dtype=np.uint32)
    keys = [bytes([i % 256, i // 256]) * 8 for i in range(512)]
    parents = [None, *keys[:-1]]
    cases = {
        "as_id_array list[512]": (lambda f: f(ids_list, "gpu"), old_ids, as_id_array),
        "as_id_array tuple[512]": (lambda f: f(ids_tuple, "gpu"), old_ids, as_id_array),
        "as_id_array int64[512]": (lambda f: f(ids_i64, "gpu"), old_ids, as_id_array),
        "as_id_array uint32[512]": (lambda f: f(ids_u32, "gpu"), old_ids, as_id_array),
        "check_parents 512": (lambda f: f(keys, parents), old_parents, check_parents),
        "check_parents 1": (lambda f: f(keys[:1], [None]), old_parents, check_parents),
    }
    for name, (call, old, new) in cases.items():
        number = max(1, args.number // (50 if "512" in name and "array" not in name else 1))
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(args.rounds):
            for label, fn in (("old", old), ("new", new)):
                best = min(timeit.repeat(lambda c=call, f=fn: c(f), number=number, repeat=3))
                times[label].append(best / number * 1e9)
        o, n = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"{name:26s} old {o:10.0f} ns  new {n:10.0f} ns  new/old {n / o:5.2f}x  "
              f"(min old {min(times['old']):.0f}, new {min(times['new']):.0f})")  # fmt: skip


if __name__ == "__main__":
    main()
