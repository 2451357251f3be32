#!/usr/bin/env bash
# Issue 27's batched host round on the H200 host's CPU (helper batched4: a store of keys all new
# indexes them in one setdefault pass, key_index.add_new), from the repo root, no network, no
# GPU needed (NullEngine), ~2 minutes:
#   bash scripts/gpu/batched4.sh        # results under $OUT/batched4/
# 1. scripts/host_pair.py between 6e89bb2 (main before this work) and this tree, paired round by
#    round: one store_many of 512 one-block keys + step() + completion with room (grow: the
#    goal row, target <= 150 us; 369 us p50 on the H200 host before), into a full LRU tier
#    (full), and loads (load: unchanged path); then the per-call rows (grow-call, full-call,
#    load-call: must not be slower). Look at "new / old" (2-core VM: grow 0.86-0.99, about
#    0.91 in the middle; full 0.97-0.99; the others ~1.0) and the new round p50 of grow.
# 2. `kvmgr bench host --rounds 200 --steps 1000`: every row and the steady state, GC on.
source "${BASH_SOURCE%/*}/_common.sh" batched4
step uptime 5 uptime
BASE=$(mktemp -d)
if base_tree 6e89bb2 "$BASE"; then
  step host_pair 30 python3 scripts/host_pair.py "$BASE" --rounds 300 --modes grow full load \
    --json "$D/host_pair.json"
  step host_pair_call 25 python3 scripts/host_pair.py "$BASE" --rounds 60 \
    --modes grow-call full-call load-call --json "$D/host_pair_call.json"
else
  echo "no tree for 6e89bb2: the pairs skipped" | tee -a "$LOG"
fi
rm -rf "$BASE"
step bench_host 70 python3 -m kvmgr.cli bench host --rounds 200 --steps 1000 --json "$D/bench_host.json"
tail -n 40 "$LOG"
