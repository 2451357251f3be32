#!/usr/bin/env bash
# Issue 27's batched host round on the H200 host's CPU (helper batched3: work the batched path
# provably does not need, after batched2's BlockLru), from the repo root, no network, no GPU
# needed (NullEngine), ~2.3 minutes:
#   bash scripts/gpu/batched3.sh        # results under $OUT/batched3/
# 1. scripts/host_pair.py between 373f872 (main before this work) and this tree, paired round by
#    round: one store_many of 512 one-block keys + step() + completion, with room (grow) and
#    into a full LRU tier (full); then loads (load: must not be slower) and the per-call stores
#    (grow-call, full-call). Look at "new / old" (2-core shared machine: full 0.91-0.95, grow
#    ~0.95, load ~0.93, per-call ~1.0) and the new round p50 of "full" (target <= 150 us; the
#    H200 host had 517 us before batched2, ~390 us expected after it: ~365 us expected here).
# 2. `kvmgr bench host --rounds 200 --steps 1000`: every row and the steady state, GC on.
source "${BASH_SOURCE%/*}/_common.sh" batched3
step uptime 5 uptime
BASE=$(mktemp -d)
git archive 373f872 kvmgr 2>/dev/null | tar -x -C "$BASE" 2>/dev/null
for run in "host_pair 35 400 grow full" "host_pair_more 30 100 load grow-call full-call"; do
  set -- $run
  name=$1 secs=$2 rounds=$3
  shift 3
  [ -d "$BASE/kvmgr" ] || { echo "no git history here: $name skipped" | tee -a "$LOG"; continue; }
  step "$name" "$secs" python3 scripts/host_pair.py "$BASE" --rounds "$rounds" --modes "$@" \
    --json "$D/$name.json"
done
rm -rf "$BASE"
step bench_host 80 python3 -m kvmgr.cli bench host --rounds 200 --steps 1000 --json "$D/bench_host.json"
tail -n 40 "$LOG"
