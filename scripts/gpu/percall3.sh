#!/usr/bin/env bash
# Issue 27's per-call host round on the H200 host's CPU (helper percall3: no getpid() system
# call per call through asyncio's running-loop check, the settle's keys indexed in one pass, LRU
# victims without links removed without array passes, the per-call load's small lists), from
# the repo root, no network, no GPU needed (NullEngine), ~2.5 minutes:
#   bash scripts/gpu/percall3.sh        # results under $OUT/percall3/
# 1. scripts/host_pair.py between 6a1cf30 (main before this work) and this tree, paired round by
#    round: the per-call rows (grow-call: the goal row, <= 1 ms p50; 1,391 us on a slow call
#    and 760 in another session on the H200 host before; full-call, load-call), then the batched
#    rows (grow, full, load: unchanged paths). Look at "new / old" (2-core VM: grow-call
#    0.77-0.84, full-call 0.79-0.84, load-call 0.81-0.85; batched 0.94-1.05).
# 2. `kvmgr bench host --rounds 200 --steps 1000` (its "per-call" rows, the steady state's
#    round p50 and full GCs: 0 expected).
source "${BASH_SOURCE%/*}/_common.sh" percall3
step uptime 5 uptime
BASE=$(mktemp -d)
if base_tree 6a1cf30 "$BASE"; then
  step host_pair_call 45 python3 scripts/host_pair.py "$BASE" --rounds 100 \
    --modes grow-call full-call load-call --json "$D/host_pair_call.json"
  step host_pair 30 python3 scripts/host_pair.py "$BASE" --rounds 200 --modes grow full load \
    --json "$D/host_pair.json"
else
  echo "no tree for 6a1cf30: the pairs skipped" | tee -a "$LOG"
fi
rm -rf "$BASE"
step bench_host 70 python3 -m kvmgr.cli bench host --rounds 200 --steps 1000 --json "$D/bench_host.json"
tail -n 40 "$LOG"
