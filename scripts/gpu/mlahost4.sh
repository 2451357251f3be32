#!/usr/bin/env bash
# Issue 27 (helper mlahost4) on the H200, from the repo root, no network; limits add up to 90 s:
#   bash scripts/gpu/mlahost4.sh         # results under $OUT/mlahost4/ (log.txt + JSON)
# 0. env: versions.
# 1. tests: the MLA insert's GPU tests (the graph through the steady record: the capture query
#    now asked after the launch, skipped on the default stream), the steady / C cell-writer /
#    stream-handle tests on CUDA: all must pass.
# 2. bench_old / bench_new: `kvmgr bench mla-insert --tokens 1,16,128,512 --modes eager` (FP8
#    e4m3 and auto) for main at the branch point ($MLAHOST4_BASE, default 42ae48b, carried in
#    build/bases/42ae48b) and this tree, each from its own root. Host rows "grouped" (a new
#    cache set each call) and "grouped same caches" (one cache set, new step tensors): target
#    <= 10 us per call (main on the H200: FP8 max 10.2 / 10.1, auto max 9.5 / 9.4); "hook"
#    stays <= 10.
# 3. pair: scripts/gpu/mlahost3_pair.py, both trees in ONE process on the real driver (FP8),
#    samples interleaved: min / median per tree and the per-pair ratio new/old.
source "${BASH_SOURCE%/*}/_common.sh" mlahost4
D=$(cd "$D" && pwd)
step env 5 python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name())"
OLD=/tmp/mlahost4_old  # the base tree, outside $OUT: nothing of it comes back
rm -rf "$OLD" && mkdir -p "$OLD"
base_tree "${MLAHOST4_BASE:-42ae48b}" "$OLD" || echo "no base tree for ${MLAHOST4_BASE:-42ae48b}" | tee -a "$LOG"
step tests 30 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_mla_insert.py \
  tests/kernels/test_launch.py -k "gpu or steady or cell_writer or stream_handle or capture"
BENCH="-m kvmgr.cli bench mla-insert --tokens 1,16,128,512 --modes eager --reps 15"
# from the old tree's root: `python3 -m` puts the working directory first on sys.path
step bench_old 20 bash -c "cd '$OLD' && PYTHONPATH='$SITE_PATH$OLD' python3 $BENCH --json '$D/bench_old.json'"
step bench_new 20 python3 $BENCH --json "$D/bench_new.json"
step pair 15 python3 scripts/gpu/mlahost3_pair.py "$OLD" --tokens 1,128 --rounds 10 --json "$D/pair.json"
grep -E "^=== |passed|failed|error" "$LOG" | tail -n 12
sed -n '/=== pair (/,/=== pair rc/p' "$LOG"
python3 - "$D" <<'PY'
import json, os, sys
print("bench mla-insert host us (eager): tree dtype T, grouped / grouped_same / hook")
for tree in ("old", "new"):
    path = os.path.join(sys.argv[1], f"bench_{tree}.json")
    rows = json.load(open(path))["rows"] if os.path.exists(path) else []
    print("\n".join(f"{tree} {r['kv_cache_dtype']:9s} T={r['tokens']:<5d} " + " / ".join(f"{r.get(c + '_host_us') or float('nan'):.2f}" for c in ("grouped", "grouped_same", "hook")) for r in rows) or f"{tree}: no JSON")
PY
