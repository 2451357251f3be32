#!/usr/bin/env bash
# Issue 27, step() host time (helper stepcost), on the H200, from the repo root; results under
# $OUT/stepcost/ (log.txt, step_{old,new}_{1,2}.json, cpu_ab.txt). About 1.5-2 minutes: limits
# 10 + 2 x 30 + 2 x 20 + 25 s (the first runs may compile Triton; the second round of section 2
# runs only if under 60 s have passed). The GPU
# tests of the code this helper touched (test_plan, test_cuda_engine, test_copy_kernel,
# test_copy_blocks, test_manager_engines) run in the suite (`gpu_round4.sh suite stepcost`).
# Old tree = this helper's branch point off main (a0c022e; else `git merge-base HEAD main`),
# extracted with git archive; new tree = this checkout. Each tree's bench runs from its own
# root (`python3 -m` puts the working directory first on sys.path: run from this checkout, the
# old tree's PYTHONPATH would import the new kvmgr).
#  1. The versions (python, torch, the GPU).
#  2. `kvmgr bench swap` step table: 512 queued one-block stores of 48 x 4 KiB pages, cuda engine
#     on consecutive ids (target step() host <= 150 us; last measured 391) and kernel engine on
#     scattered ids (target <= 300 us; last 329); old and new alternately, twice if time allows.
#     Look at the summary: host / manager / engine per tree and new/old.
#  3. scripts/step_cost_ab.py on the H200 host's CPU: both trees in one process, step by step
#     (fake CUDA, stub driver: kvmgr's Python share of a step without driver calls).
source "${BASH_SOURCE%/*}/_common.sh" stepcost
source "${BASH_SOURCE%/*}/_step_table.sh"
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
BASE=a0c022e
git rev-parse --verify -q "$BASE^{commit}" >/dev/null 2>&1 || BASE=$(git merge-base HEAD main 2>/dev/null)

step env 10 python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"

step_table_ab "$BASE" 60
[ -n "$BASE" ] && step cpu_ab 25 bash -c "python3 scripts/step_cost_ab.py --old $BASE --repeats 100 \
  --json '$D/cpu_ab.json' | tee '$D/cpu_ab.txt'"

echo "=== stepcost summary (base $BASE)"
python3 scripts/gpu/step_summary.py "$D"
[ -f "$D/cpu_ab.txt" ] && { echo "cpu a/b (one process):"; cat "$D/cpu_ab.txt"; }
grep -E "^=== .* rc=" "$LOG"
