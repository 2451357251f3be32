"""Host CPU us per call of the hook and grouped-insert launch paths: an old tree vs this one.

    git archive d4df0e3 kvmgr | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    python3 scripts/launch_host_ab.py /tmp/old [--runs 3] [--tokens 64]
    python3 scripts/launch_host_ab.py /tmp/old --bench "--tokens 1,16,128 --rounds 20" [--runs 3]

``--bench ARGS``: both trees have ``kvmgr bench launch-host``; it runs with ARGS in each tree's
own root (``-C``, ``PYTHONPATH`` = that root), old and new alternately, ``--runs`` times, and the
table gives per row the minimum of the runs' minima, the median of their medians, and new/old of
both (``--json PATH`` keeps them).

The same rows as ``kvmgr bench launch-host`` (which the old tree lacks), on a stand-in GPU: Triton
compiles the real kernels for ``cuda:90`` behind a stub driver (``kvmgr.bench.stub_gpu`` of this
tree), every packed launch calls a C no-op through ctypes (libm's ``fegetround``), CPU tensors
stand in for device memory. The old tree's packed launches (``kvmgr.kernels.packed_launch``) get
the same no-op. Each tree runs in its own process, alternately, ``--runs`` times; a row is the
minimum over runs of the minimum over 60 samples of ~256 calls (thread CPU time), so a shared
machine inflates it least. Not a GPU figure: the driver's own time (5.6-7.1 us per launch on the
H200 host) is excluded from both columns alike.
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
import ctypes, ctypes.util, importlib.util, json, os, statistics, sys, time
src, here, out, T = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
spec = importlib.util.spec_from_file_location("stub_gpu", os.path.join(here, "kvmgr/bench/stub_gpu.py"))
stub = importlib.util.module_from_spec(spec)
sys.path.insert(0, src)
import numpy as np, torch
if os.path.exists(os.path.join(src, "kvmgr/kernels/launch/rule.py")):  # this tree's layout
    from kvmgr.bench import stub_gpu
    stub_gpu.install()
else:  # the tree before the launch package: its packed launches and checks by hand
    sys.path.insert(0, here)
    spec.loader.exec_module(stub)
    from triton.runtime.driver import driver
    driver.set_active(stub._triton_driver(stub.StubGpu()))
    sys.path.remove(here)
    for name in [k for k in sys.modules if k.startswith("kvmgr")]:
        del sys.modules[name]
    from kvmgr.kernels import packed_launch
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.fegetround.restype = ctypes.c_int
    class Libcuda:
        launch = libm.fegetround
        def current_context(self): return 1
        def error_name(self, result): return str(result)
    packed_launch._driver = lambda: Libcuda()
    torch._C._cuda_getDevice = (0).__index__
    torch._C._cuda_getCurrentRawStream = {0: 7}.get
    from kvmgr.kernels.mla import api, bound, host
    api.IS_INTERPRETED = bound.IS_INTERPRETED = host.IS_INTERPRETED = True
assert sys.modules["kvmgr"].__file__.startswith(src)
from kvmgr.hooks import StepContext
from kvmgr.kernels.c128.hook import C128CompressorHook
from kvmgr.kernels.c128.layout import c128_entry_bytes
from kvmgr.kernels.c128.reference import rope_cos_sin_cache
from kvmgr.kernels.mla.api import grouped_mla_insert
from kvmgr.kernels.mla.hook import GroupedMLAInsertHook

def timed(calls):
    repeats = max(1, 256 // len(calls))
    for call in calls * 2:
        call()
    samples = []
    for _ in range(60):
        start = time.thread_time()
        for _ in range(repeats):
            for call in calls:
                call()
        samples.append((time.thread_time() - start) * 1e6 / (repeats * len(calls)))
    return min(samples)

L, R, P, B = 5, 512, 64, 64
gen = torch.Generator().manual_seed(0)
sets = []
for _ in range(16):
    nb = -(-T // B) + 1
    rows = torch.randn(L, T, R + P, generator=gen).bfloat16()
    sets.append({"kv": rows[..., :R].contiguous(), "pe": rows[..., R:].contiguous(),
                 "caches": [torch.empty(nb, B, R + P, dtype=torch.float8_e4m3fn) for _ in range(L)],
                 "slots": torch.randperm(nb * B, generator=gen)[:T], "scales": torch.rand(L, generator=gen) + 0.1})
first, fp8 = sets[0], {"kv_cache_dtype": "fp8_e4m3"}
ctxs = [StepContext(tensors={"kv_c": s["kv"], "k_pe": s["pe"], "slot_mapping": s["slots"]}) for s in sets]
hooks = [GroupedMLAInsertHook(s["caches"], kv_scales=s["scales"], **fp8) for s in sets]
unchecked = [GroupedMLAInsertHook(s["caches"], kv_scales=s["scales"], validate=False, **fp8) for s in sets]
res = {
    "grouped, 16 rotating cache sets": timed([lambda s=s: grouped_mla_insert(s["kv"], s["pe"], s["caches"], s["slots"], kv_scales=s["scales"], **fp8) for s in sets]),
    "grouped, one cache set, new step tensors": timed([lambda s=s: grouped_mla_insert(s["kv"], s["pe"], first["caches"], s["slots"], kv_scales=first["scales"], **fp8) for s in sets]),
    "grouped, the same tensors every call": timed([lambda: grouped_mla_insert(first["kv"], first["pe"], first["caches"], first["slots"], kv_scales=first["scales"], **fp8)]),
    "MLA hook per set, validate": timed([lambda h=h, c=c: h(c) for h, c in zip(hooks, ctxs)]),
    "MLA hook, new step tensors": timed([lambda c=c, h=hooks[0]: h(c) for c in ctxs]),
    "MLA hook, validate=False": timed([lambda h=h, c=c: h(c) for h, c in zip(unchecked, ctxs)]),
}
D, S = 512, 8
layer = {"state_cache": torch.randn(64, S, 2 * D, generator=gen),
         "compressed_cache": torch.zeros(16, 4, c128_entry_bytes(D), dtype=torch.uint8),
         "ape": torch.randn(128, D, generator=gen), "norm_weight": torch.rand(D, generator=gen),
         "cos_sin_cache": rope_cos_sin_cache(4096)}
tensors = {"positions": torch.tensor([126]), "c128.state_slot_mapping": torch.tensor([126]),
           "c128.state_block_table": torch.arange(64, dtype=torch.int32).view(1, 64),
           "c128.req_indices": torch.zeros(1, dtype=torch.int32), "c128.slot_mapping": torch.tensor([0]),
           "c128.kv": torch.randn(1, D, generator=gen).bfloat16(), "c128.score": torch.randn(1, D, generator=gen).bfloat16()}
meta = {"num_computed_tokens": np.array([126]), "query_start_loc": np.array([0, 1])}
ctx = StepContext(tensors=tensors, **meta)
gated, ungated = C128CompressorHook(**layer), C128CompressorHook(**layer, gated=False)
fresh = [StepContext(tensors={k: v.clone() for k, v in tensors.items()}, **meta) for _ in range(16)]
res["c128 hook, B=1 non-boundary, gated"] = timed([lambda: gated(ctx)])
res["c128 hook, B=1 non-boundary, ungated"] = timed([lambda: ungated(ctx)])
res["c128 hook, gated, new step tensors"] = timed([lambda c=c: gated(c) for c in fresh])
json.dump(res, open(out, "w"))
"""


def _run(tree: Path, tokens: int, out: Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    subprocess.run([sys.executable, "-c", _CHILD, str(tree), str(HERE), str(out), str(tokens)],
                   check=True, env=env)  # fmt: skip
    result: dict[str, float] = json.loads(out.read_text())
    return result


def _bench(tree: Path, bench_args: str, out: Path) -> dict[str, tuple[float, float]]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env["PYTHONPATH"] = str(tree)
    command = [sys.executable, "-m", "kvmgr.cli", "bench", "launch-host", *bench_args.split(), "--json", str(out)]  # fmt: skip
    subprocess.run(command, check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())["rows"]
    return {r["row"]: (r["min_us"], r["median_us"]) for r in rows}


def _bench_pairs(old: Path, bench_args: str, runs: int, json_path: str | None) -> None:
    """``--bench``: the launch-host rows of both trees, alternately (module docstring)."""
    seen: dict[str, dict[str, list[tuple[float, float]]]] = {"old": {}, "new": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(runs):
            for name, tree in (("old", old), ("new", HERE)):
                for row, us in _bench(tree, bench_args, Path(tmp) / f"{name}{run}.json").items():
                    seen[name].setdefault(row, []).append(us)
    table = []
    for row, olds in seen["old"].items():
        news = seen["new"].get(row)
        if not news:
            continue
        old_min, new_min = min(u[0] for u in olds), min(u[0] for u in news)
        old_med, new_med = statistics.median(u[1] for u in olds), statistics.median(u[1] for u in news)  # fmt: skip
        table.append({"row": row, "old_min": old_min, "new_min": new_min, "old_median": old_med, "new_median": new_med})  # fmt: skip
    print(f"{'launch-host, us per call (stub driver)':84s} {'old min':>8s} {'new min':>8s} {'ratio':>6s} {'old med':>8s} {'new med':>8s} {'ratio':>6s}")  # fmt: skip
    for r in table:
        print(f"{r['row'][:84]:84s} {r['old_min']:8.2f} {r['new_min']:8.2f} {r['new_min'] / r['old_min']:6.2f} {r['old_median']:8.2f} {r['new_median']:8.2f} {r['new_median'] / r['old_median']:6.2f}")  # fmt: skip
    if json_path:
        Path(json_path).write_text(json.dumps({"args": bench_args, "runs": runs, "rows": table}, indent=2))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("old", type=Path, help="an older kvmgr tree (its parent of kvmgr/)")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs per tree")
    parser.add_argument("--tokens", type=int, default=64, help="MLA step size T")
    parser.add_argument("--bench", metavar="ARGS", default=None,
                        help="run `kvmgr bench launch-host ARGS` in both trees instead")  # fmt: skip
    parser.add_argument("--json", default=None, help="with --bench: write the table as JSON")
    args = parser.parse_args()
    if args.bench is not None:
        _bench_pairs(args.old.resolve(), args.bench, args.runs, args.json)
        return
    best: dict[str, dict[str, float]] = {"old": {}, "new": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for name, tree in (("old", args.old.resolve()), ("new", HERE)):
                rows = _run(tree, args.tokens, Path(tmp) / f"{name}{run}.json")
                for row, us in rows.items():
                    best[name][row] = min(us, best[name].get(row, us))
    print(f"{'host CPU us per call (stub driver), T = ' + str(args.tokens):48s} {'old':>8s} {'new':>8s} {'new/old':>8s}")  # fmt: skip
    for row, old in best["old"].items():
        new = best["new"][row]
        print(f"{row:48s} {old:8.2f} {new:8.2f} {new / old:8.2f}")


if __name__ == "__main__":
    main()
