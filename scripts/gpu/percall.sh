#!/usr/bin/env bash
# Issue 27's per-call store path on the H200 host's CPU (helper percall), from the repo root:
#   bash scripts/gpu/percall.sh        # ~2 minutes; results under $OUT/percall/
# 1. scripts/host_ab.py: the tree at a0c022e (main before the per-call futures) against this
#    one, alternating processes: 512 one-block stores per call and batched (round = calls +
#    step() + completion, NullEngine) and the 2000-round steady state into a full CPU tier
#    (round p50/p99, full GCs). Targets: per-call round p50 <= 1 ms, 0 full GCs.
# 2. `kvmgr bench host --steps 2000`: the full table of this tree.
source "${BASH_SOURCE%/*}/_common.sh" percall
step env 20 python3 -c "import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, numpy.__version__)"
BASE=$(mktemp -d)
step base 20 bash -c "git archive a0c022e kvmgr | tar -x -C '$BASE'"
step host_ab 110 python3 scripts/host_ab.py "$BASE" --runs 2 --rounds 200 --steps 2000 \
  --vllm-steps 0 --json "$D/host_ab.json"
step bench_host 60 python3 -m kvmgr.cli bench host --rounds 200 --steps 2000 --json "$D/bench_host.json"
tail -n 40 "$LOG"
