#!/usr/bin/env bash
# Issue 27 (helper mlahost3) on the H200, from the repo root, no network; limits add up to 125 s:
#   bash scripts/gpu/mlahost3.sh         # results under $OUT/mlahost3/ (log.txt + JSON)
# 0. env: versions.
# 1. tests: the MLA insert's, c128's and the launch package's GPU tests plus the steady-loop,
#    persistent-buffer, meta-device and C cell-writer tests on CUDA: all must pass.
# 2. bench_old / bench_new: `kvmgr bench mla-insert --tokens 1,16,128 --modes eager` (FP8 e4m3)
#    for main at the branch point ($MLAHOST3_BASE, default 6e89bb2) and this tree, each from
#    its own root. Look at the host rows "grouped" (a new cache set each call) and "grouped
#    same caches" (one cache set, new step tensors): target <= 10 us per call (last H200 runs:
#    10.7-12.3 and 10.7-12.6 us); "hook" stays <= 10 (7.5-8.6).
# 3. pair: scripts/gpu/mlahost3_pair.py, both trees in ONE process on the real driver, samples
#    interleaved: min / median per tree and the per-pair ratio new/old for the same four rows;
#    then the per-call pieces the real driver adds (the capture query, current device and
#    stream, one packed launch alone): what is left between the stub figure and this host's.
source "${BASH_SOURCE%/*}/_common.sh" mlahost3
BASE=${MLAHOST3_BASE:-6e89bb2}
D=$(cd "$D" && pwd)
OLD=/tmp/mlahost3_old  # outside $OUT: nothing of it comes back
rm -rf "$OLD" && mkdir -p "$OLD" && base_tree "$BASE" "$OLD" || echo "no base tree for $BASE" | tee -a "$LOG"
step env 5 python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name())"
step tests 50 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_mla_insert.py \
  tests/kernels/test_c128.py tests/kernels/test_launch.py \
  -k "gpu or steady or meta or persistent or cell_writer or checked or guarded or turned_off"
BENCH="-m kvmgr.cli bench mla-insert --tokens 1,16,128 --kv-cache-dtypes fp8_e4m3 --modes eager --reps 15"
# from the old tree's root: `python3 -m` puts the working directory first on sys.path
step bench_old 20 bash -c "cd '$OLD' && PYTHONPATH='$SITE_PATH$OLD' python3 $BENCH --json '$D/bench_old.json'"
step bench_new 20 python3 $BENCH --json "$D/bench_new.json"
step pair 30 python3 scripts/gpu/mlahost3_pair.py "$OLD" --tokens 1,16,128 --rounds 24 --json "$D/pair.json"
grep -E "^=== |passed|failed|error" "$LOG" | tail -n 16
sed -n '/=== pair (/,/=== pair rc/p' "$LOG"
python3 - "$D" <<'PY'
import json, os, sys
d = sys.argv[1]
cols = ("grouped", "grouped_same", "hook", "hook_unchecked")
print("bench mla-insert host us (fp8, eager)  " + "  ".join(f"{c:>14s}" for c in cols))
for tree in ("old", "new"):
    path = os.path.join(d, f"bench_{tree}.json")
    if not os.path.exists(path):
        print(f"{tree}: no JSON"); continue
    for r in json.load(open(path))["rows"]:
        cells = "  ".join(f"{r.get(c + '_host_us') or float('nan'):14.2f}" for c in cols)
        print(f"{tree} T={r['tokens']:<5d}                      {cells}")
PY
