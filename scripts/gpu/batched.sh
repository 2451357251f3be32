#!/usr/bin/env bash
# Issue 27's batched host round on the H200 host's CPU (helper batched), from the repo root, no
# network, no GPU needed (the host path runs NullEngine), ~2.5 minutes:
#   bash scripts/gpu/batched.sh        # results under $OUT/batched/
# 1. When the repo has its git history: scripts/host_pair.py between a0c022e (main before this
#    work) and this tree, paired round by round: one store_many of 512 one-block keys + step() +
#    completion, with room (grow) and into a full LRU tier (full). Look at "new / old" (2-core
#    shared machine: grow 0.90, full 0.77-0.79) and the new round p50 (target <= 150 us; the
#    H200 host had 670 us before this work).
# 2. `kvmgr bench host --rounds 200 --steps 1000`: the batched and per-call rows and the steady
#    state with the GC on (target: batched round p50 <= 150 us).
source "${BASH_SOURCE%/*}/_common.sh" batched
step uptime 5 uptime
OLD=$(mktemp -d)
if git archive a0c022e kvmgr 2>/dev/null | tar -x -C "$OLD" 2>/dev/null && [ -d "$OLD/kvmgr" ]; then
  step host_pair 50 python3 scripts/host_pair.py "$OLD" --rounds 400 --json "$D/host_pair.json"
else
  echo "no git history here: host_pair skipped" | tee -a "$LOG"
fi
rm -rf "$OLD"
step bench_host 90 python3 -m kvmgr.cli bench host --rounds 200 --steps 1000 --json "$D/bench_host.json"
tail -n 40 "$LOG"
