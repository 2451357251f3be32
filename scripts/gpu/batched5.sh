#!/usr/bin/env bash
# Issue 27's batched host round on the H200 host's CPU (helper batched5: fewer numpy calls and
# no per-key lists on the batched store's path), from the repo root, no network, no GPU needed
# (NullEngine), ~20 s on a quiet machine, 2 minutes at most:
#   bash scripts/gpu/batched5.sh        # results under $OUT/batched5/
# Carry build/bases/51e895a (main before this work: `mkdir -p build/bases/51e895a && git
# archive 51e895a kvmgr | tar -x -C build/bases/51e895a`) when the checkout may lack it.
# 1. scripts/host_pair.py between 51e895a and this tree, paired round by round: one store_many
#    of 512 one-block keys + step() + completion with room (grow: the goal row, <= 150 us; 242
#    us p50 on the H200 host before), into a full LRU tier (full), loads (load); then the
#    per-call rows (grow-call, full-call: must not be slower). Look at "new / old" (2-core VM:
#    grow 0.90-0.96, full 0.88-0.93, load ~0.96, per-call ~1.0) and the new grow p50.
# 2. `kvmgr bench host --rounds 200 --steps 1000`: every row and the steady state, GC on.
source "${BASH_SOURCE%/*}/_common.sh" batched5
BASE=$(mktemp -d)
pairs() { local name=$1 secs=$2 rounds=$3; shift 3  # host_pair.py of the base against this tree
  step "$name" "$secs" python3 scripts/host_pair.py "$BASE" --rounds "$rounds" --modes "$@" \
    --json "$D/$name.json"; }
step uptime 5 uptime
base_tree 51e895a "$BASE" && pairs host_pair 40 300 grow full load \
  && pairs host_pair_call 30 60 grow-call full-call \
  || echo "no tree for 51e895a (or a pair run failed): see above" | tee -a "$LOG"
rm -rf "$BASE"
step bench_host 50 python3 -m kvmgr.cli bench host --rounds 200 --steps 1000 --json "$D/bench_host.json"
tail -n 40 "$LOG"
