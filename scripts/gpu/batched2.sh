#!/usr/bin/env bash
# Issue 27's batched host round on the H200 host's CPU (helper batched2: the CPU tier's LRU kept
# by CPU block), from the repo root, no network, no GPU needed (NullEngine), ~2.3 minutes:
#   bash scripts/gpu/batched2.sh        # results under $OUT/batched2/
# 1. scripts/host_pair.py between 1c18726 (main before this work) and this tree, paired round by
#    round: one store_many of 512 one-block keys + step() + completion, with room (grow) and
#    into a full LRU tier (full); then the same keys through 512 swap_out calls (grow-call,
#    full-call: must not be slower), and loads (load, load-call). Look at "new / old" (2-core shared machine: grow ~0.70,
#    full ~0.75, per-call stores ~0.9, loads ~1.0-1.08: the LRU touch of 512 hits costs ~15 us more)
#    and the new round p50 of "full" (target <= 150 us; the H200
#    host had 517 us before this work).
# 2. `kvmgr bench host --rounds 200 --steps 1000`: every row and the steady state, GC on.
source "${BASH_SOURCE%/*}/_common.sh" batched2
step uptime 5 uptime
OLD=$(mktemp -d)
if git archive 1c18726 kvmgr 2>/dev/null | tar -x -C "$OLD" 2>/dev/null && [ -d "$OLD/kvmgr" ]; then
  step host_pair 35 python3 scripts/host_pair.py "$OLD" --rounds 400 --json "$D/host_pair.json"
  step host_pair_call 30 python3 scripts/host_pair.py "$OLD" --rounds 100 \
    --modes grow-call full-call load load-call --json "$D/host_pair_call.json"
else
  echo "no git history here: host_pair skipped" | tee -a "$LOG"
fi
rm -rf "$OLD"
step bench_host 80 python3 -m kvmgr.cli bench host --rounds 200 --steps 1000 --json "$D/bench_host.json"
tail -n 40 "$LOG"
