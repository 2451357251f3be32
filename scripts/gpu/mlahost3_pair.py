"""The public grouped MLA insert's host time on the real driver, an old kvmgr tree against this
one IN ONE PROCESS (issue 27, helper mlahost3), on a CUDA GPU.

    python3 scripts/gpu/mlahost3_pair.py OLD_ROOT [--tokens 1,16,128] [--rounds 30] [--json PATH]

``OLD_ROOT/kvmgr`` is copied as ``kvmgr_old`` (imports renamed: ``scripts/launch_host_pair.py``)
and both trees run the same calls, samples alternating old, new, new, old, ... Rows (L = 5,
R = 512, P = 64, FP8 e4m3 caches of block 64, bf16 rows; ``kvmgr bench mla-insert``'s cases):
``grouped_mla_insert`` over 16 rotating cache sets, each with its own step tensors (its
"grouped" column: a new cache set each call), over one cache set with the sets' step tensors
(its "grouped same caches": a serving loop), the MLA hook per set (its "hook") and one hook over
new step tensors. A sample: the queue drained, then 64 calls timed with ``perf_counter`` (wall
us per call, the real ``cuLaunchKernelEx`` included). Per row: min and median of each tree and
the median of the per-pair ratios new/old. Target: <= 10 us per call for the public function.

Then the per-call pieces this host pays on the real driver and the stub does not (us, best of 7
x 2,000): the capture query of the public function, the current device and raw stream of every
packed launch, one packed launch alone (the hook's bound launch, its cells as they are, through
kvmgr's C call), and one trivial driver call (``cuCtxGetCurrent``) through ctypes and through
cuda-python: what each binding adds to a call.
"""

from __future__ import annotations

import importlib
import json
import shutil
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(HERE / "scripts"), str(HERE)]
from launch_host_pair import _renamed_copy, pair_parser  # noqa: E402

_CALLS = 64


def _sets(num_tokens: int) -> list[dict[str, Any]]:
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    num_blocks = -(-num_tokens // 64) + 1
    sets = []
    for _ in range(16):
        rows = (torch.randn(5, num_tokens, 576, device="cuda", generator=gen) * 4).bfloat16()
        sets.append({
            "kv_c": rows[..., :512].contiguous(), "k_pe": rows[..., 512:].contiguous(),
            "caches": [torch.empty(num_blocks, 64, 576, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(5)],
            "slots": torch.randperm(num_blocks * 64, device="cuda", generator=gen)[:num_tokens],
            "kwargs": {"kv_cache_dtype": "fp8_e4m3", "kv_scales": torch.rand(5, device="cuda", generator=gen) + 0.1},
        })  # fmt: skip
    return sets


def _cases(pkg: str, sets: list[dict[str, Any]]) -> dict[str, list[Callable[[], object]]]:
    api = importlib.import_module(f"{pkg}.kernels.mla.api")
    hook_mod, hooks = importlib.import_module(f"{pkg}.kernels.mla.hook"), importlib.import_module(f"{pkg}.hooks")  # fmt: skip
    insert, first = api.grouped_mla_insert, sets[0]
    ctxs = [hooks.StepContext(tensors={"kv_c": s["kv_c"], "k_pe": s["k_pe"], "slot_mapping": s["slots"]}) for s in sets]  # fmt: skip
    per_set = [hook_mod.GroupedMLAInsertHook(s["caches"], **s["kwargs"]) for s in sets]
    # fmt: off
    return {
        "grouped_mla_insert, a new cache set each call (bench: grouped)": [lambda s=s: insert(s["kv_c"], s["k_pe"], s["caches"], s["slots"], **s["kwargs"]) for s in sets],
        "grouped_mla_insert, one cache set, new step tensors (same caches)": [lambda s=s: insert(s["kv_c"], s["k_pe"], first["caches"], s["slots"], **s["kwargs"]) for s in sets],
        "MLA hook per set (bench: hook)": [lambda h=h, c=c: h(c) for h, c in zip(per_set, ctxs, strict=True)],
        "MLA hook, new step tensors": [lambda c=c, h=per_set[0]: h(c) for c in ctxs],
    }
    # fmt: on


def _sample(calls: list[Callable[[], object]]) -> float:
    torch.cuda.synchronize()
    repeats = max(1, _CALLS // len(calls))
    start = time.perf_counter()
    for _ in range(repeats):
        for call in calls:
            call()
    elapsed = time.perf_counter() - start
    return elapsed * 1e6 / (repeats * len(calls))


def _pairs(tokens: list[int], rounds: int) -> list[dict[str, Any]]:
    rows = []
    print(f"{'host wall us per call, real driver, one process':70s} {'old min':>8s} {'new min':>8s} {'old med':>8s} {'new med':>8s} {'new/old':>8s}")  # fmt: skip
    for num_tokens in tokens:
        sets = _sets(num_tokens)
        old, new = _cases("kvmgr_old", sets), _cases("kvmgr", sets)
        for name, old_calls in old.items():
            new_calls = new[name]
            for call in (old_calls + new_calls) * 4:  # warm up: compile, bind, guards, records
                call()
            olds, news, ratios = [], [], []
            for turn in range(rounds):
                first, second = (old_calls, new_calls) if turn % 2 == 0 else (new_calls, old_calls)
                a, b = _sample(first), _sample(second)
                o, n = (a, b) if turn % 2 == 0 else (b, a)
                olds.append(o), news.append(n), ratios.append(n / o)
            row = {"row": f"T={num_tokens} {name}", "old_min": min(olds), "new_min": min(news),
                   "old_median": statistics.median(olds), "new_median": statistics.median(news),
                   "ratio_median": statistics.median(ratios)}  # fmt: skip
            rows.append(row)
            print(f"{row['row']:70s} {row['old_min']:8.2f} {row['new_min']:8.2f} {row['old_median']:8.2f} {row['new_median']:8.2f} {row['ratio_median']:8.3f}")  # fmt: skip
        torch.cuda.synchronize()
    return rows


def _pieces() -> dict[str, float]:
    from kvmgr.kernels.mla.hook import GroupedMLAInsertHook

    s = _sets(1)[0]
    hook = GroupedMLAInsertHook(s["caches"], **s["kwargs"])
    from kvmgr.hooks import StepContext

    hook(StepContext(tensors={"kv_c": s["kv_c"], "k_pe": s["k_pe"], "slot_mapping": s["slots"]}))
    last = hook._insert._last
    bound, grid = last[6], last[5]
    get_stream = torch._C._cuda_getCurrentRawStream  # type: ignore[attr-defined]
    pieces = {
        "torch._C._cuda_isCurrentStreamCapturing()": torch._C._cuda_isCurrentStreamCapturing,  # type: ignore[attr-defined]
        "torch._C._cuda_getDevice()": torch._C._cuda_getDevice,  # type: ignore[attr-defined]
        "torch._C._cuda_getCurrentRawStream(0)": lambda: get_stream(0),
        "one packed launch alone (bound.launch)": lambda: bound.launch(grid, None),
        "cuCtxGetCurrent through ctypes (kvmgr's Libcuda)": bound._driver.current_context,
    }
    try:  # the same trivial driver call through cuda-python (the binding a launch could use)
        from cuda.bindings import driver as cuda_driver

        pieces["cuCtxGetCurrent through cuda-python"] = cuda_driver.cuCtxGetCurrent
    except ImportError:
        pass
    out = {}
    for name, fn in pieces.items():
        best = min(timeit.repeat(fn, number=2000, repeat=7)) / 2000 * 1e6
        torch.cuda.synchronize()
        out[name] = best
        print(f"{name:70s} {best:8.3f} us")
    return out


def main() -> None:
    args = pair_parser(__doc__ or "", 30).parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    tmp = Path(tempfile.mkdtemp(prefix="kvmgr_pair_"))
    try:
        _renamed_copy(args.old.resolve(), tmp)
        sys.path.insert(0, str(tmp))
        rows = _pairs([int(t) for t in args.tokens.split(",")], args.rounds)
        pieces = _pieces()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"old": str(args.old), "rows": rows, "pieces": pieces}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
