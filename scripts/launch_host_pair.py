"""Host us per call of the MLA and c128 hot paths, an old kvmgr tree against this one IN ONE PROCESS.

    git archive main kvmgr | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    python3 scripts/launch_host_pair.py /tmp/old [--tokens 1,16,128] [--rounds 40] [--json PATH]
        [--kv-cache-dtype fp8_e4m3,auto]

A 2-core shared machine changes speed between processes (the same row moves by up to 2x between
two runs of ``kvmgr bench launch-host``), so two trees timed in two processes, even alternately,
compare noise. Here the old tree is copied to a temporary folder as the package ``kvmgr_old``
(every ``kvmgr.`` / ``from kvmgr import`` in its sources renamed), both are imported into one
process behind this tree's stub driver (:mod:`kvmgr.bench.stub_gpu`: Triton compiles the real
kernels for ``cuda:90``, each packed launch calls a C no-op; CPU tensors stand in for device
memory), and each row's samples alternate old, new, new, old, ... (~256 calls per sample,
thread CPU time). Per row: min and median of each tree's samples and the median of the per-pair
ratios new/old (the figure that survives the machine's changes of speed). Rows: the public
``grouped_mla_insert`` (one cache set with new step tensors, a serving loop; the same tensors
every call; 16 rotating cache sets), the MLA hook (new step tensors; one hook per set), and the
c128 hook (gated with the same and with new step tensors, ungated), L = 5, R = 512, P = 64, FP8
e4m3 caches (``--kv-cache-dtype``: the MLA rows for each dtype given, ``auto`` = bf16 caches), D = 512 (``kvmgr bench launch-host``'s cases). Not a GPU figure: the driver's own
time is excluded from both columns alike.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]


def _renamed_copy(old: Path, into: Path) -> None:
    """``old``/kvmgr copied to ``into``/kvmgr_old with its imports of kvmgr renamed."""
    shutil.copytree(old / "kvmgr", into / "kvmgr_old")
    pattern = re.compile(r"\bkvmgr(\.|(?= import))")
    for path in (into / "kvmgr_old").rglob("*.py"):
        path.write_text(pattern.sub(r"kvmgr_old\1", path.read_text()))


def _cases(pkg: str, num_tokens: int, with_c128: bool, kv_cache_dtype: str = "fp8_e4m3") -> dict[str, list[Callable[[], object]]]:  # fmt: skip
    import numpy as np
    import torch

    def mod(name: str) -> Any:
        return importlib.import_module(f"{pkg}.{name}")

    api, hook_mod, hooks, c128 = mod("kernels.mla.api"), mod("kernels.mla.hook"), mod("hooks"), mod("kernels.c128.hook")  # fmt: skip
    bench = mod("bench.launch_host")
    sets = bench._mla_sets(argparse.Namespace(layers=5, sets=16, kv_cache_dtype=kv_cache_dtype), num_tokens)  # fmt: skip
    first, insert = sets[0], api.grouped_mla_insert
    ctxs = [hooks.StepContext(tensors={"kv_c": s["kv_c"], "k_pe": s["k_pe"], "slot_mapping": s["slots"]}) for s in sets]  # fmt: skip
    per_set = [hook_mod.GroupedMLAInsertHook(s["caches"], **s["kwargs"]) for s in sets]
    tag = f"T={num_tokens}" if kv_cache_dtype == "fp8_e4m3" else f"T={num_tokens} {kv_cache_dtype}"
    # fmt: off
    cases: dict[str, list[Callable[[], object]]] = {
        f"{tag} grouped_mla_insert, one cache set, new step tensors": [lambda s=s: insert(s["kv_c"], s["k_pe"], first["caches"], s["slots"], **s["kwargs"]) for s in sets],
        f"{tag} grouped_mla_insert, the same tensors every call": [lambda: insert(first["kv_c"], first["k_pe"], first["caches"], first["slots"], **first["kwargs"])],
        f"{tag} grouped_mla_insert, 16 rotating cache sets": [lambda s=s: insert(s["kv_c"], s["k_pe"], s["caches"], s["slots"], **s["kwargs"]) for s in sets],
        f"{tag} MLA hook, new step tensors": [lambda c=c, h=per_set[0]: h(c) for c in ctxs],
        f"{tag} MLA hook per set (its own tensors)": [lambda h=h, c=c: h(c) for h, c in zip(per_set, ctxs, strict=True)],
    }
    # fmt: on
    if with_c128:
        layer, tensors = bench._c128_case(torch.Generator().manual_seed(128))
        meta = {"num_computed_tokens": np.array([126]), "query_start_loc": np.array([0, 1])}
        ctx = hooks.StepContext(tensors=tensors, **meta)
        gated, ungated = c128.C128CompressorHook(**layer), c128.C128CompressorHook(**layer, gated=False)  # fmt: skip
        fresh = [hooks.StepContext(tensors={k: v.clone() for k, v in tensors.items()}, **meta) for _ in range(16)]  # fmt: skip
        cases["c128 hook, gated, the same tensors"] = [lambda: gated(ctx)]
        cases["c128 hook, gated, new step tensors"] = [lambda c=c: gated(c) for c in fresh]
        cases["c128 hook, ungated, the same tensors"] = [lambda: ungated(ctx)]
    return cases


def _sample(calls: list[Callable[[], object]], repeats: int) -> float:
    start = time.thread_time()
    for _ in range(repeats):
        for call in calls:
            call()
    return (time.thread_time() - start) * 1e6 / (repeats * len(calls))


def pair_parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The options of an in-process old / new pair: the old tree, ``--tokens``, ``--rounds``
    (default ``rounds``) and ``--json`` (also used by ``scripts/gpu/mlahost3_pair.py``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("old", type=Path, help="an older kvmgr tree (the parent of its kvmgr/)")
    parser.add_argument("--tokens", default="1,16,128", help="MLA step sizes T")
    parser.add_argument("--rounds", type=int, default=rounds, help="samples per tree and row")
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    parser.add_argument(
        "--kv-cache-dtype",
        default="fp8_e4m3",
        help="MLA cache dtypes, comma-separated (fp8_e4m3, auto)",
    )
    return parser


def main() -> None:
    args = pair_parser(__doc__ or "", 40).parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvmgr_pair_"))
    try:
        _renamed_copy(args.old.resolve(), tmp)
        sys.path[:0] = [str(HERE), str(tmp)]
        from kvmgr.bench import stub_gpu
        from kvmgr.kernels.launch import launcher

        stub_gpu.install()
        importlib.import_module("kvmgr_old.kernels.launch.launcher").driver = launcher.driver
        importlib.import_module("kvmgr_old.kernels.mla.plan").IS_INTERPRETED = True
        rows = _measure(
            [int(t) for t in args.tokens.split(",")], args.rounds, args.kv_cache_dtype.split(",")
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"old": str(args.old), "rounds": args.rounds, "rows": rows}, indent=2))  # fmt: skip


def _measure(tokens: list[int], rounds: int, dtypes: list[str]) -> list[dict[str, Any]]:
    rows = []
    print(f"{'host CPU us per call, one process (stub driver)':58s} {'old min':>8s} {'new min':>8s} {'old med':>8s} {'new med':>8s} {'new/old':>8s}")  # fmt: skip
    for num_tokens, dtype in [(t, d) for t in tokens for d in dtypes]:
        c128 = num_tokens == tokens[0] and dtype == dtypes[0]
        old, new = _cases("kvmgr_old", num_tokens, c128, dtype), _cases("kvmgr", num_tokens, c128, dtype)  # fmt: skip
        for name, old_calls in old.items():
            new_calls, repeats = new[name], max(1, 256 // len(old_calls))
            for call in (old_calls + new_calls) * 3:  # warm up: compile, bind, guard
                call()
            olds, news, ratios = [], [], []
            for turn in range(rounds):
                first, second = (old_calls, new_calls) if turn % 2 == 0 else (new_calls, old_calls)
                a, b = _sample(first, repeats), _sample(second, repeats)
                o, n = (a, b) if turn % 2 == 0 else (b, a)
                olds.append(o), news.append(n), ratios.append(n / o)
            row = {"row": name, "old_min": min(olds), "new_min": min(news), "old_median": statistics.median(olds),
                   "new_median": statistics.median(news), "ratio_median": statistics.median(ratios)}  # fmt: skip
            rows.append(row)
            print(f"{name:58s} {row['old_min']:8.2f} {row['new_min']:8.2f} {row['old_median']:8.2f} {row['new_median']:8.2f} {row['ratio_median']:8.3f}")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
