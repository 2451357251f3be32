#!/usr/bin/env bash
# Issue 27, the engines' own submit (helper stepengine), on the H200, from the repo root; results
# under $OUT/stepengine/ (log.txt, step_{old,new}_{1,2}.json, pieces_{cuda,kernel}_{old,new}.json).
# About 2-2.5 minutes: limits 20 + 2 x 30 (+ 2 x 20 for a second round, only if under 35 s have
# passed) + 60 + 15 + 4 x 15 s; each bench run is 10-15 s.
# Old tree = main at 51e895a (the start of round 4 session 9; carried in build/bases/51e895a, else
# git archive; STEP_BASE overrides), new tree = this checkout; each tree's bench from its own root
# with PYTHONPATH set to that root only.
#  1. The versions (python, torch, the GPU) and whether the C call module builds here.
#  2. `kvmgr bench swap` step table (512 queued one-block stores of 48 x 4 KiB pages; cuda engine
#     on consecutive ids, target step() host <= 150 us, last 202-341; kernel engine on scattered
#     ids, target <= 300 us, last 229-399), old and new alternately, twice if time allows. Look at
#     the summary: host / manager / engine per tree and new/old ("engine" = the engine's submit).
#  3. The GPU tests of what changed: tests/transfer/test_cuda_engine.py (real copies through both
#     engines, the pooled tables and events), test_dma.py (the one-call path against the
#     general one), test_cuda_current.py (device_is_current / on_device, event_calls),
#     test_driver_call.py, tests/kernels/test_copy_kernel.py, test_copy_blocks.py (the copy
#     kernels against torch with poisoned padding), test_copy_staging.py (one pooled slot
#     serving every table kind: the kept 1s row) and test_staged_gpu.py (engine "auto"'s staged
#     path, through KernelCopy). A failure here: revert this branch.
#  4. The current-device read on this torch (best of 5 x 20000): torch.cuda.current_device()
#     against kvmgr's device_is_current (torch's C reader once initialized), and on_device.
#  5. scripts/step_pieces.py with the real engines, cuda then kernel, each tree (old first): the
#     engine's pieces (DmaCopy.issue, BlockPairs.descriptor_table, CopyDriver.batch_at,
#     KernelCopy.issue, CopyStager.copy_runs, on_device / device_is_current, the event calls,
#     CopyStreams._queue, CopyStreams.submit, CudaEngine.submit) min / p10 / median us.
source "${BASH_SOURCE%/*}/_common.sh" stepengine
source "${BASH_SOURCE%/*}/_step_table.sh"
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
BASE=${STEP_BASE:-51e895a}

env_step 20

step_table_ab "$BASE" 35

step gpu_tests 60 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/transfer/test_cuda_engine.py \
  tests/transfer/test_dma.py tests/transfer/test_cuda_current.py tests/transfer/test_driver_call.py \
  tests/kernels/test_copy_kernel.py tests/kernels/test_copy_blocks.py tests/kernels/test_copy_staging.py \
  tests/transfer/test_staged_gpu.py

device_read_step

OLD_TREE=$(mktemp -d)
if base_tree "$BASE" "$OLD_TREE"; then
  mkdir -p "$OLD_TREE/scripts"  # step_pieces.py's ROOT: the old tree (the fake rig beside it, for a CPU run)
  cp scripts/step_pieces.py scripts/step_cost_ab.py scripts/_fake_cuda.py "$OLD_TREE/scripts/"
  for engine in cuda kernel; do
    step "pieces_${engine}_old" 15 bash -c "cd '$OLD_TREE' && PYTHONPATH='$SITE_PATH$OLD_TREE' python3 scripts/step_pieces.py \
      --engine $engine --repeats 40 --json '$D/pieces_${engine}_old.json'"
    step "pieces_${engine}_new" 15 python3 scripts/step_pieces.py --engine $engine --repeats 40 \
      --json "$D/pieces_${engine}_new.json"
  done
else
  echo "no old tree: the old pieces are skipped" | tee -a "$LOG"
  for engine in cuda kernel; do
    step "pieces_${engine}_new" 15 python3 scripts/step_pieces.py --engine $engine --repeats 40 \
      --json "$D/pieces_${engine}_new.json"
  done
fi
rm -rf "$OLD_TREE"

echo "=== stepengine summary (base $BASE)"
python3 scripts/gpu/step_summary.py "$D"
grep -E "C call:|passed|failed|^device read" "$LOG"
grep -E "^=== pieces|host_s|batch_at|descriptor_table|_record|_wait|DmaCopy.issue|KernelCopy|copy_runs|on_device|device_is_current|_queue|CopyStreams.submit|CudaEngine.submit|Flusher.flush" "$LOG"
grep -E "^=== .* rc=" "$LOG"
