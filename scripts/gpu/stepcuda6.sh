#!/usr/bin/env bash
# Issue 27, step() host time with one event record fewer per batch (helper stepcuda6), on the
# H200, from the repo root; results under $OUT/stepcuda6/ (log.txt, step_{old,new}_{1,2}.json,
# pieces_cuda_{old,new}.json). About 2-2.5 minutes: limits 15 + 2 x 30 (+ 2 x 20 for a second
# round, only if under 50 s have passed) + 45 + 2 x 15 s; each bench run is 10-15 s.
# Old tree = main at 1ee9787 (the start of round 4 session 10; carried in build/bases/1ee9787,
# else git archive; STEP_BASE overrides), new tree = this checkout; each tree's bench from its
# own root with PYTHONPATH set to that root only.
#  1. The versions (python, torch, the GPU) and whether the C call module builds here.
#  2. `kvmgr bench swap` step table (512 queued one-block stores of 48 x 4 KiB pages; cuda engine
#     on consecutive ids, target step() host <= 150 us, last 169-319; kernel engine on scattered
#     ids, target <= 300 us), old and new alternately, twice if time allows. Look at the summary:
#     host / manager / engine per tree and new/old ("engine" = the engine's submit, which now
#     makes three event calls instead of four: fence record, its wait, end record).
#  3. The GPU tests of what changed: tests/transfer/test_stream_timing.py (device_s on the
#     device: a store behind a 0.1 s kernel and one queued behind another are timed by their
#     copies alone, with fresh and pooled events), test_cuda_engine.py (real copies, pooled
#     events), test_layerwise_gpu.py (layerwise groups on pooled events), test_cuda_current.py,
#     test_dma.py, test_driver_call.py. A timing test failing here: revert the branch.
#  4. scripts/step_pieces.py with the real cuda engine, each tree (old first): the records per
#     step ("CopyStreams._record (event)" n: 2 per step new, 3 old), CopyStreams.submit,
#     CudaEngine.submit, _queue, batch_at, min / p10 / median us.
source "${BASH_SOURCE%/*}/_common.sh" stepcuda6
source "${BASH_SOURCE%/*}/_step_table.sh"
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
BASE=${STEP_BASE:-1ee9787}

step env 15 python3 -c "import sys, torch; from kvmgr.transfer.driver_call import native_call; \
print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(), 'C call:', native_call())"

step_table_ab "$BASE" 50

step gpu_tests 45 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/transfer/test_stream_timing.py \
  tests/transfer/test_cuda_engine.py tests/transfer/test_layerwise_gpu.py tests/transfer/test_cuda_current.py \
  tests/transfer/test_dma.py tests/transfer/test_driver_call.py

OLD_TREE=$(mktemp -d)
if base_tree "$BASE" "$OLD_TREE"; then
  mkdir -p "$OLD_TREE/scripts"  # step_pieces.py's ROOT: the old tree (the fake rig beside it, for a CPU run)
  cp scripts/step_pieces.py scripts/step_cost_ab.py scripts/_fake_cuda.py "$OLD_TREE/scripts/"
  step pieces_cuda_old 15 bash -c "cd '$OLD_TREE' && PYTHONPATH='$SITE_PATH$OLD_TREE' python3 scripts/step_pieces.py \
    --engine cuda --repeats 40 --json '$D/pieces_cuda_old.json'"
else
  echo "no old tree: the old pieces are skipped" | tee -a "$LOG"
fi
step pieces_cuda_new 15 python3 scripts/step_pieces.py --engine cuda --repeats 40 --json "$D/pieces_cuda_new.json"
rm -rf "$OLD_TREE"

echo "=== stepcuda6 summary (base $BASE)"
python3 scripts/gpu/step_summary.py "$D"
grep -E "C call:|passed|failed" "$LOG"
grep -E "^=== pieces|host_s|batch_at|descriptor_table|_record|_wait|DmaCopy.issue|device_is_current|_queue|CopyStreams.submit|CudaEngine.submit|Flusher.flush" "$LOG"
grep -E "^=== .* rc=" "$LOG"
