#!/usr/bin/env bash
# Issue 27, step() host time (helper stepcost), on the H200, from the repo root; results under
# $OUT/stepcost/ (log.txt, step_{old,new}_{1,2}.json, cpu_ab.txt). About 2.5 minutes: limits
# 5 + 40 + 4 x 20 + 25 s (the second round of section 2 runs only if under 75 s have passed).
# Old tree = this helper's branch point off main (a0c022e; else `git merge-base HEAD main`),
# extracted with git archive; new tree = this checkout. Each tree's bench runs from its own
# root (`python3 -m` puts the working directory first on sys.path: run from this checkout, the
# old tree's PYTHONPATH would import the new kvmgr).
#  1. GPU tests of the code this helper touched: test_plan, test_cuda_engine, test_copy_kernel,
#     test_copy_blocks, test_manager_engines (real engines, bytes compared on random data).
#  2. `kvmgr bench swap` step table: 512 queued one-block stores of 48 x 4 KiB pages, cuda engine
#     on consecutive ids (target step() host <= 150 us; last measured 391) and kernel engine on
#     scattered ids (target <= 300 us; last 329); old and new alternately, twice if time allows.
#     Look at the summary: host / manager / engine per tree and new/old.
#  3. scripts/step_cost_ab.py on the H200 host's CPU: both trees in one process, step by step
#     (fake CUDA, stub driver: kvmgr's Python share of a step without driver calls).
source "${BASH_SOURCE%/*}/_common.sh" stepcost
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
NEW="$PWD"
BASE=a0c022e
git rev-parse --verify -q "$BASE^{commit}" >/dev/null 2>&1 || BASE=$(git merge-base HEAD main 2>/dev/null)
STEP_ARGS="--geometries qwen --blocks 64 --variants none --repeats 10 --warmup 3 --step-swaps 512 --step-engines cuda kernel"

step env 5 python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
step gpu_tests 40 python3 -m pytest -q -p no:randomly tests/transfer/test_plan.py \
  tests/transfer/test_cuda_engine.py tests/kernels/test_copy_kernel.py \
  tests/kernels/test_copy_blocks.py tests/manager/test_manager_engines.py

OLD=""
if [ -n "$BASE" ]; then
  OLD="$(mktemp -d)"
  git archive "$BASE" kvmgr | tar -x -C "$OLD" || OLD=""
fi
[ -z "$OLD" ] && echo "no git history: the old tree's rows are skipped" | tee -a "$LOG"
for run in 1 2; do
  [ "$run" = 2 ] && [ "$SECONDS" -gt 75 ] && { echo "second round skipped (time)" | tee -a "$LOG"; break; }
  for tree in old new; do
    root="$NEW"; [ "$tree" = old ] && root="$OLD"
    [ -z "$root" ] && continue
    step "step_${tree}_$run" 20 bash -c "cd '$root' && PYTHONPATH='$root' python3 -m kvmgr.cli bench swap \
      $STEP_ARGS --json '$D/step_${tree}_$run.json'"
  done
done
[ -n "$BASE" ] && step cpu_ab 25 bash -c "python3 scripts/step_cost_ab.py --old $BASE --repeats 100 \
  --json '$D/cpu_ab.json' | tee '$D/cpu_ab.txt'"

echo "=== stepcost summary (base $BASE)"
python3 scripts/gpu/step_summary.py "$D"
[ -f "$D/cpu_ab.txt" ] && { echo "cpu a/b (one process):"; cat "$D/cpu_ab.txt"; }
grep -E "passed|failed|error" "$LOG" | tail -n 3
