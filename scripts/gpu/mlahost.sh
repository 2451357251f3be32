#!/usr/bin/env bash
# Issue 27: host cost of the grouped FP8 MLA insert and the per-step hooks on the H200, the tree
# before helper mlahost's branch ("old") against this one ("new"), from the repo root, no network:
#   bash scripts/gpu/mlahost.sh          # ~150 s; results under $OUT/mlahost/ (log + JSON)
# The old tree is `git archive $MLAHOST_BASE kvmgr` (default a0c022e, the branch point off main;
# `git merge-base HEAD main` names it only before the merge) or the kvmgr tree in $MLAHOST_OLD.
# 0. env; the old tree's source.
# 1. the MLA GPU tests, plus the non-GPU tests of the step signature run on CUDA (a bad step
#    after good ones raises before writing; remembered signatures write exactly): all must pass.
# 2. `kvmgr bench launch-host --tokens 1,64` (the Python around a stub driver, this host's CPU)
#    and `kvmgr bench mla-insert --tokens 1,16,128 --reps 15 --modes eager` (the real driver),
#    old, new, old, new. Targets (host us per call, eager): "grouped same caches" (the public
#    function, one cache set, new step tensors: 13.5-16.4 before) and "hook" <= 10 us; the same
#    rows of launch-host say what the Python costs (driver excluded).
# 3. `kvmgr bench peer --halves mla` (new tree): eager and host kvmgr vs the C++ op, same run.
# The last lines: the old/new table (min over the two runs of each tree; ratio new/old).
source "${BASH_SOURCE%/*}/_common.sh" mlahost
BASE=${MLAHOST_BASE:-a0c022eb63760139b5e9965a19ee20e078315064}
D=$(cd "$D" && pwd)
if [ -n "${MLAHOST_OLD:-}" ]; then OLD=$(cd "$MLAHOST_OLD" && pwd)
else OLD=$D/old; mkdir -p "$OLD"; git archive "$BASE" kvmgr | tar -x -C "$OLD"; fi
step env 15 python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name()); print('old tree:', sys.argv[1])" "$OLD"
step tests 40 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_mla_insert.py \
  -k "gpu or bad_step_after or remembered_step or validation_raises or same_step or packed_path"
MLA="--tokens 1,16,128 --reps 15 --modes eager --kv-cache-dtypes fp8_e4m3"
for run in 1 2; do
  for tree in old new; do
    if [ $tree = old ]; then at=(env -C "$OLD" PYTHONPATH="$OLD"); else at=(env); fi
    step "launch_host_${tree}$run" 15 "${at[@]}" python3 -m kvmgr.cli bench launch-host \
      --tokens 1,64 --rounds 30 --json "$D/launch_host_${tree}$run.json"
    step "mla_insert_${tree}$run" 20 "${at[@]}" python3 -m kvmgr.cli bench mla-insert $MLA \
      --json "$D/mla_insert_${tree}$run.json"
  done
done
step peer_mla 30 python3 -m kvmgr.cli bench peer --halves mla --mla-tokens 1,16,128 \
  --mla-repeats 5 --mla-json "$D/peer_mla.json"
grep -E "^=== |passed|failed|error" "$LOG" | tail -n 30
python3 - "$D" <<'EOF'
import glob, json, os, sys
d = sys.argv[1]
def best(pattern, rows_of):
    out = {}
    for path in glob.glob(os.path.join(d, pattern)):
        for name, us in rows_of(json.load(open(path))):
            if us is not None:
                out[name] = min(us, out.get(name, us))
    return out
host = lambda r: [(x["row"], x["min_us"]) for x in r["rows"]]
mla = lambda r: [(f"T={x['tokens']} {k[:-8]}", v) for x in r["rows"] for k, v in x.items() if k.endswith("_host_us")]
for title, pattern, rows_of in (("launch-host, stub driver, min us", "launch_host_%s*.json", host),
                                ("mla-insert eager host, median us", "mla_insert_%s*.json", mla)):
    old, new = best(pattern % "old", rows_of), best(pattern % "new", rows_of)
    print(f"{title:88s} {'old':>7s} {'new':>7s} {'new/old':>7s}")
    for name in new:
        o, n = old.get(name), new[name]
        print(f"{name:88s} {o or float('nan'):7.2f} {n:7.2f} {n / o if o else float('nan'):7.2f}")
EOF
