#!/usr/bin/env bash
# Issue 27, the cuda engine's submit on the copy streams (helper stepcuda5), on the H200, from the
# repo root; results under $OUT/stepcuda5/ (log.txt, step_{old,new}_{1,2}.json,
# pieces_cuda_{old,new}.json). About 2 minutes: limits 20 + 2 x 30 (+ 2 x 20 for a second round,
# only if under 40 s have passed) + 60 + 15 + 2 x 15 s; each bench run is 10-15 s.
# Old tree = main at 42ae48b (round 4 session 9 after wave 1; carried in build/bases/42ae48b, else
# git archive; STEP_BASE overrides), new tree = this checkout; each tree's bench from its own root
# with PYTHONPATH set to that root only.
#  1. The versions and whether the C modules build (kvmgr_driver_call, and kvmgr_fence_start:
#     fence_start, the fence record, its wait and the start record in one C call, and
#     fenced_batch, those plus cuMemcpyBatchAsync and the end record); this also compiles them
#     into Triton's cache once, so the timed runs do not pay the build.
#  2. `kvmgr bench swap` step table (512 queued one-block stores of 48 x 4 KiB pages; cuda engine
#     on consecutive ids, target step() host <= 150 us, main 42ae48b 188-319; kernel engine on
#     scattered ids, target <= 300 us, met), old and new alternately, twice if time allows.
#  3. The GPU tests of what changed: tests/transfer/test_fence_start.py (the fused C call against
#     the calls one by one, on real events too), test_fused_batch.py (real copies through the
#     fused call, poisoned host blocks), test_cuda_current.py (event_calls, DriverEvents on real events,
#     a thread with no context yet), test_cuda_engine.py (real copies, pooled events),
#     test_driver_call.py, test_dma.py. A failure here: revert this branch.
#     test_cuda_current.py also runs a forked child and a fresh process: device_is_current (now
#     torch's C reader without the initialized / bad-fork checks) must say what
#     torch.cuda.current_device() says there (torch's error in the child). A failure there:
#     revert the device_is_current commit only.
#  4. The current-device read (best of 5 x 20000): torch.cuda.current_device() and
#     device_is_current.
#  5. scripts/step_pieces.py with the real cuda engine, each tree (old first): the in-step pieces
#     (FusedBatch.issue, DmaCopy.prepare and CopyStreams._fence_start (event) where the new tree
#     has them, _record / _wait, CopyDriver.batch_at (the old tree's),
#     CopyStreams.submit, CudaEngine.submit, Flusher.flush) min / p10 / median us.
source "${BASH_SOURCE%/*}/_common.sh" stepcuda5
source "${BASH_SOURCE%/*}/_step_table.sh"
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
BASE=${STEP_BASE:-$(branch_base stepcuda5 42ae48b)}

step env 20 python3 -c "import sys, torch; from kvmgr.transfer.driver_call import native_call, native_fence_start, native_fenced_batch; \
print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(), 'C call:', native_call(), \
'fence_start:', native_fence_start(), 'fenced_batch:', native_fenced_batch())"

step_table_ab "$BASE" 40

step gpu_tests 60 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/transfer/test_fence_start.py \
  tests/transfer/test_fused_batch.py \
  tests/transfer/test_cuda_current.py tests/transfer/test_cuda_engine.py tests/transfer/test_driver_call.py \
  tests/transfer/test_dma.py

step device_read 15 python3 -c "
import timeit, torch
from kvmgr.transfer.cuda_current import device_is_current
dev = torch.device('cuda', torch.cuda.current_device())
torch.cuda.Stream(dev)  # CUDA initialized, as an engine finds it
for name, fn in (('torch.cuda.current_device()', torch.cuda.current_device),
                 ('device_is_current', lambda: device_is_current(dev))) * 2:
    best = min(timeit.repeat(fn, number=20000, repeat=5)) / 20000 * 1e6
    print(f'device read {name}: {best:.3f} us')
assert device_is_current(dev)
"

OLD_TREE=$(mktemp -d)
if base_tree "$BASE" "$OLD_TREE"; then
  mkdir -p "$OLD_TREE/scripts"  # step_pieces.py's ROOT: the old tree
  cp scripts/step_pieces.py scripts/step_cost_ab.py scripts/_fake_cuda.py "$OLD_TREE/scripts/"
  step pieces_cuda_old 15 bash -c "cd '$OLD_TREE' && PYTHONPATH='$SITE_PATH$OLD_TREE' python3 scripts/step_pieces.py \
    --engine cuda --repeats 40 --json '$D/pieces_cuda_old.json'"
else
  echo "no old tree: the old pieces are skipped" | tee -a "$LOG"
fi
step pieces_cuda_new 15 python3 scripts/step_pieces.py --engine cuda --repeats 40 \
  --json "$D/pieces_cuda_new.json"
rm -rf "$OLD_TREE"

echo "=== stepcuda5 summary (base $BASE)"
python3 scripts/gpu/step_summary.py "$D"
grep -E "C call:|passed|failed|^device read" "$LOG"
grep -E "^=== pieces|host_s|FusedBatch|prepare|_fence_start|_record|_wait|batch_at|DmaCopy.issue|device_is_current|_queue|CopyStreams.submit|CudaEngine.submit|TransferWorker.submit|Flusher.flush" "$LOG"
grep -E "^=== .* rc=" "$LOG"
