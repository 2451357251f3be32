#!/usr/bin/env bash
# Issue 27's per-call store round on the H200 host's CPU (helper percall2), from the repo root:
#   bash scripts/gpu/percall2.sh        # ~2 minutes; results under $OUT/percall2/
# 1. scripts/host_pair.py --modes grow-call full-call: main before this helper (1c18726) against this tree,
#    two processes taking turns round by round: 512 swap_out([id], [key]) + step() + completion
#    (NullEngine), modes grow-call (no eviction: `kvmgr bench host`'s round) and full-call (every round
#    evicts 512). Look at: new round p50 (target <= 1,000 us) and new / old (aim <= 0.85).
# 2. The same for the batched round (must not get slower: new / old about 1.0).
# 3. Each tree's steady state: 1000 per-call rounds into a full tier, round p50 and full GCs
#    (target 0), old and new alternately.
source "${BASH_SOURCE%/*}/_common.sh" percall2
step env 10 python3 -c "import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, numpy.__version__)"
BASE=$(mktemp -d)
step base 10 bash -c "git archive 1c18726 kvmgr | tar -x -C '$BASE'"
step pair_per_call 50 python3 scripts/host_pair.py "$BASE" --modes grow-call full-call --rounds 400 \
  --json "$D/pair_per_call.json"
step pair_batched 25 python3 scripts/host_pair.py "$BASE" --rounds 300 --json "$D/pair_batched.json"
STEADY='import asyncio, json, sys
sys.path.insert(0, sys.argv[1])
from kvmgr.bench import host
r = asyncio.run(host._steady("per-call", 1000))
print(sys.argv[1], json.dumps({k: r[k] for k in ("round_us_p50", "round_us_p99", "full_collections")}))'
for tree in "$BASE" "$PWD" "$BASE" "$PWD"; do step steady 12 python3 -c "$STEADY" "$tree"; done
tail -n 40 "$LOG"
