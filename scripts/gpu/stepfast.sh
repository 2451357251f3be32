#!/usr/bin/env bash
# Issue 27, the step path above the engine (helper stepfast): the Flusher, LocalTransport and
# TransferWorker layers with fewer frames and reads (the moved check bound once, a one-lane
# generation without the order list, the outcome read once, the settle inlined), the landed
# stores' ``stored`` event without the parents list, the no-copy engine's done handle in one
# frame. On the H200, from the repo root; results under $OUT/stepfast/ (log.txt,
# step_{old,new}_{1,2}.json, host_pair.json, round_ab.json, cost_ab.json,
# pieces_{cuda,kernel}.json). About 2-2.5 minutes: limits 20 + 2 x 30 (+ 2 x 20 if under 50 s
# have passed) + 35 + 20 + 30 + 30 + 2 x 20 s; each bench run is 10-15 s.
# Old tree = 1ee9787 (main at the start of round 4 session 10; carried in build/bases/1ee9787,
# else git archive; STEP_BASE overrides); new tree = this checkout; each tree's bench from its own
# root with PYTHONPATH set to that root only.
#  1. The versions (python, torch, the GPU).
#  2. `kvmgr bench swap` step table: 512 queued one-block stores of 48 x 4 KiB pages, cuda engine
#     on consecutive ids (target step() host <= 150 us; last 169-319) and kernel engine on
#     scattered ids (target <= 300 us; last 199-300); old and new alternately, twice if time
#     allows. The summary: host / manager / plan / engine per tree and new / old.
#  3. scripts/host_pair.py against the old tree (grow, full, load; 200 pairs): `kvmgr bench
#     host`'s batched round (store_many of 512 fresh keys + step() + completion, 48 tensors,
#     the no-copy engine; target <= 150 us p50, last 223), paired round by round, new / old.
#  4. scripts/round_step_ab.py --old 1ee9787 (the batched round of 3., both trees in ONE
#     process, rounds alternating: calls, step host_s, step + completion, round) and
#     scripts/step_cost_ab.py --old 1ee9787 (both trees in one process, fake CUDA and a stub
#     driver: kvmgr's Python share of the cuda and kernel steps on this host's CPU); the old tree
#     from build/bases/1ee9787 (else git archive; skipped where neither has it).
#  5. The tests of what changed that use the GPU: the manager state machine (its CUDA cases:
#     cancellation at random points, bytes compared) and tests/scheduler/test_step_fast_paths.py
#     (the rank groups' tests are CPU-only and passed on the VM).
#  6. scripts/step_pieces.py with the real engines, cuda then kernel: Flusher.flush,
#     Flusher._submit, LocalTransport.submit, TransferWorker.submit, CudaEngine.submit min / p10 /
#     median us (the layers above the engine: their differences).
source "${BASH_SOURCE%/*}/_common.sh" stepfast
source "${BASH_SOURCE%/*}/_step_table.sh"
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
BASE=${STEP_BASE:-1ee9787}

step env 20 python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"

step_table_ab "$BASE" 50

OLD="$(mktemp -d)"
if base_tree "$BASE" "$OLD"; then
  step host_pair 35 python3 scripts/host_pair.py "$OLD" --rounds 200 --modes grow full load --json "$D/host_pair.json"
else
  echo "no old tree $BASE: host_pair skipped" | tee -a "$LOG"
fi
rm -rf "$OLD"

if [ -d "build/bases/$BASE/kvmgr" ] || git rev-parse --verify -q "$BASE^{commit}" >/dev/null 2>&1; then
  step round_ab 20 python3 scripts/round_step_ab.py --old "$BASE" --rounds 600 --json "$D/round_ab.json"
  step cost_ab 30 python3 scripts/step_cost_ab.py --old "$BASE" --repeats 150 --json "$D/cost_ab.json"
else
  echo "no git history of $BASE: step_cost_ab skipped" | tee -a "$LOG"
fi

step tests 30 python3 -m pytest -q -x -p no:randomly -p no:cacheprovider tests/manager/test_state_machine.py \
  tests/scheduler/test_step_fast_paths.py

step pieces_cuda 20 python3 scripts/step_pieces.py --engine cuda --repeats 60 --json "$D/pieces_cuda.json"
step pieces_kernel 20 python3 scripts/step_pieces.py --engine kernel --repeats 60 --json "$D/pieces_kernel.json"

echo "=== stepfast summary (base $BASE)"
python3 scripts/gpu/step_summary.py "$D"
grep -E "^\| (grow|full|load) \| [0-9]" "$LOG"
grep -E "^\| (grow|full) \| (host|step|round) " "$LOG"
grep -E "^(cuda|kernel) " "$LOG" | grep -E " host | cpu "
grep -E "passed|failed" "$LOG"
grep -E "host_s|Flusher.flush|Flusher._submit|LocalTransport.submit|TransferWorker.submit|CudaEngine.submit" "$LOG"
grep -E "^=== .* rc=" "$LOG"
