#!/usr/bin/env bash
# Issue 21 on the H200 (scheduler/worker split, TP ranks). Run from the repository root; writes
# under $OUT/split/. Sections time out on their own; a failing section does not stop the others.
# About 4 minutes in all.
#  1. the manager's GPU tests over the split (CUDA engines through TransferWorker/LocalTransport)
#  2. kvmgr bench ranks --device cuda: 1 process vs 2 processes, each with half the KV heads on
#     the one GPU (the data path of TP=2): step() host time, job latency, GB/s
#  3. the step table (kvmgr bench swap) of the pre-split tree vs this one, alternately, when
#     this checkout has git history (old tree: commit c1e724d, main before the split)
set -uo pipefail
D="$OUT/split"
mkdir -p "$D"

timeout 120 python3 -m pytest -q -p no:randomly -m gpu tests/manager/test_manager_engines.py \
  tests/manager/test_reliability.py tests/transfer/test_layerwise.py > "$D/pytest_gpu.txt" 2>&1 \
  || echo "section 1: pytest failed or timed out (see pytest_gpu.txt)"

timeout 150 python3 -m kvmgr.cli bench ranks --device cuda --engine auto --ranks 1,2 \
  --heads 8 --layers 32 --blocks 256 --rounds 30 --warmup 5 --json "$D/ranks_cuda.json" \
  > "$D/ranks_cuda.txt" 2>&1 || echo "section 2: bench ranks failed (see ranks_cuda.txt)"

if git rev-parse --verify -q c1e724d >/dev/null 2>&1; then
  OLD="$(mktemp -d)"
  git archive c1e724d kvmgr | tar -x -C "$OLD"
  for run in 1 2; do
    for tree in old new; do
      root="$PWD"; [ "$tree" = old ] && root="$OLD"
      PYTHONPATH="$root" timeout 50 python3 -m kvmgr.cli bench swap --geometries qwen llama \
        --blocks 512 --repeats 5 --warmup 2 > "$D/step_table_${tree}_${run}.txt" 2>&1 \
        || echo "section 3: bench swap ($tree, run $run) failed"
    done
  done
else
  echo "section 3: skipped (no git history here: compare with scripts/split_host_ab.py)" \
    | tee "$D/step_table_skipped.txt"
fi
