#!/usr/bin/env bash
# Round 4 session 10: is the kernel engine's step on consecutive ids slower after stepcuda6?
# `kvmgr bench swap`'s step table (kernel engine only) for three trees carried in build/bases
# (1ee9787: the session's start; nocuda6: this tree without the stepcuda6 merge; now: this
# tree), in turn, three rounds; ~90 s. Results under $OUT/kernelstep/.
source "${BASH_SOURCE%/*}/_common.sh" kernelstep
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
args="--geometries qwen --blocks 64 --variants none --repeats 10 --warmup 3 --step-swaps 512 --step-engines kernel cuda"
for run in 1 2 3; do
  for tree in 1ee9787 nocuda6 now; do
    root=$(mktemp -d); cp -r "build/bases/$tree/kvmgr" "$root/"
    step "step_${tree}_$run" 30 bash -c "cd '$root' && PYTHONPATH='$SITE_PATH$root' python3 -m kvmgr.cli bench swap $args --json '$D/step_${tree}_$run.json'"
    rm -rf "$root"
  done
done
python3 - "$D" <<'PY' | tee -a "$LOG"
import glob, json, statistics, sys
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/step_*.json")):
    tree = f.rsplit("/", 1)[1].split("_")[1]
    for r in json.load(open(f))["step"]:
        rows.setdefault((r["engine"], r["ids"], tree), []).append((r["host_us"], r["manager_us"], r["engine_us"]))
for key, v in sorted(rows.items()):
    print(*key, "host", [round(x[0]) for x in v], "median", round(statistics.median(x[0] for x in v)),
          "manager", round(statistics.median(x[1] for x in v)), "engine", round(statistics.median(x[2] for x in v)))
PY
