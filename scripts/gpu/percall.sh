#!/usr/bin/env bash
# Issue 27's per-call host path on the H200 host's CPU (helper percall), from the repo root, no
# network, no GPU needed (the host path runs NullEngine), ~3 minutes:
#   bash scripts/gpu/percall.sh        # results under $OUT/percall/
# 1. `kvmgr bench host --rounds 200 --steps 1000`: 512 one-block stores per call and batched, and
#    the steady state into a full CPU tier with its full (generation 2) collections. Targets:
#    batched round <= 150 us; per call <= 1 ms with 0 full GCs (before this work, on this host:
#    per-call p50 5,197 us, batched 1,178 us; steady per-call 9,914 us with 29 full GCs).
# 2. When the repo has its git history: scripts/host_ab.py between the commit before this work
#    (f5ab5bc, the per-call path as it was) and this tree, alternating runs (old / new ratios).
source "${BASH_SOURCE%/*}/_common.sh" percall
step uptime 5 uptime
step bench_host 90 python3 -m kvmgr.cli bench host --rounds 200 --steps 1000 --json "$D/bench_host.json"
OLD=$(mktemp -d)
if git archive f5ab5bc kvmgr 2>/dev/null | tar -x -C "$OLD" 2>/dev/null && [ -d "$OLD/kvmgr" ]; then
  step host_ab 130 python3 scripts/host_ab.py "$OLD" --runs 2 --rounds 100 --steps 500 \
    --vllm-steps 0 --json "$D/host_ab.json"
else
  echo "no git history here: host_ab skipped" | tee -a "$LOG"
fi
rm -rf "$OLD"
tail -n 60 "$LOG"
