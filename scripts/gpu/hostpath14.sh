#!/usr/bin/env bash
# Issue 27, round 4 session 14, helper hostpath14: the moved-tensor check's prefetch pass
# (kvmgr/worker/_guard_c.py: every tensor's Python word, handle, TensorImpl and StorageImpl
# prefetched before the compare). On the GPU host, from the repo root; results under
# $OUT/hostpath14/ (log.txt, step_{old,new}_{1,2}.json, round_ab.json, cost_ab.json,
# pieces_cuda.json). About 3 minutes: limits 20 + 2 x 30 (+ 2 x 20 if under 90 s have passed)
# + 30 + 20 + 30 + 20 s.
# Old tree = f1d4500 (main at the session's start; carry build/bases/f1d4500, made with
# `mkdir -p build/bases/f1d4500 && git archive f1d4500 kvmgr | tar -x -C build/bases/f1d4500`;
# STEP_BASE overrides); new tree = this checkout; each tree's bench from its own root.
#  1. The versions (python, torch, the GPU).
#  2. `kvmgr bench swap` step table, old and new in turn, two rounds: step() host for 512 queued
#     one-block stores of 48 x 4 KiB pages, cuda consecutive (goal <= 150 us; H100 201-269 at
#     the session's start) and kernel scattered (goal <= 300 us).
#  3. The GPU tests of the check (the shim check on CUDA tensors).
#  4. scripts/round_step_ab.py (the batched round, both trees in ONE process; goal <= 150 us p50)
#     and scripts/step_cost_ab.py (kvmgr's Python share of the step, fake CUDA, one process).
#  5. scripts/step_pieces.py with the real cuda engine: TensorGuard.moved among the pieces
#     (9.5 us median on the H100 in session 13).
source "${BASH_SOURCE%/*}/_common.sh" hostpath14
source "${BASH_SOURCE%/*}/_step_table.sh"
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
BASE=${STEP_BASE:-f1d4500}

step env 20 python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"

step_table_ab "$BASE" 90

step tests 30 python3 -m pytest -q -x -p no:randomly -p no:cacheprovider \
  tests/manager/test_guard_shim.py tests/manager/test_tensor_guard.py

if [ -d "build/bases/$BASE/kvmgr" ] || git rev-parse --verify -q "$BASE^{commit}" >/dev/null 2>&1; then
  step round_ab 20 python3 scripts/round_step_ab.py --old "$BASE" --rounds 600 --json "$D/round_ab.json"
  step cost_ab 30 python3 scripts/step_cost_ab.py --old "$BASE" --repeats 150 --json "$D/cost_ab.json"
else
  echo "no tree for $BASE: round_step_ab and step_cost_ab skipped" | tee -a "$LOG"
fi

step pieces_cuda 20 python3 scripts/step_pieces.py --engine cuda --repeats 60 --json "$D/pieces_cuda.json"

echo "=== hostpath14 summary (base $BASE)"
python3 scripts/gpu/step_summary.py "$D"
grep -E "^\| (grow|full) \| (host|step|round|calls) " "$LOG"
grep -E "^(cuda|kernel) " "$LOG" | grep -E " host | cpu "
grep -E "passed|failed" "$LOG"
grep -E "host_s|TensorGuard.moved|Flusher.flush" "$LOG"
grep -E "^=== .* rc=" "$LOG"
