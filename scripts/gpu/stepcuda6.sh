#!/usr/bin/env bash
# Issue 27, step() host time with one event record fewer per batch (helper stepcuda6), on the
# H200, from the repo root; results under $OUT/stepcuda6/ (log.txt, step_{old,new}_{1,2}.json,
# pieces_cuda_{old,new}.json). About 2-2.5 minutes: limits 15 + 2 x 30 (+ 2 x 20 for a second
# round, only if under 45 s have passed) + 45 + 15 + 20 + 2 x 15 s; each bench run is 10-15 s.
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
#  4. The current-device read (best of 5 x 20000): torch.cuda.current_device() against
#     device_is_current (torch's C reader, now without the initialized / fork checks) and
#     on_device; cuMemcpyBatchAsync of 1, 8, 24, 48 descriptors of 4 KiB (device -> pinned, from
#     C, one call on an idle stream each, 300 calls: min / p10 / median), the driver's own cost
#     per descriptor (what a layout with fewer descriptors per step would save).
#  5. scripts/step_pieces.py with the real cuda engine, each tree (old first): the records per
#     step ("CopyStreams._record (event)" n: 2 per step new, 3 old), CopyStreams.submit,
#     CudaEngine.submit, _queue, batch_at, min / p10 / median us.
source "${BASH_SOURCE%/*}/_common.sh" stepcuda6
source "${BASH_SOURCE%/*}/_step_table.sh"
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
BASE=${STEP_BASE:-1ee9787}

env_step 15

step_table_ab "$BASE" 45

step gpu_tests 45 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/transfer/test_stream_timing.py \
  tests/transfer/test_cuda_engine.py tests/transfer/test_layerwise_gpu.py tests/transfer/test_cuda_current.py \
  tests/transfer/test_dma.py tests/transfer/test_driver_call.py

device_read_step

step batch_sizes 20 python3 -c "
import statistics, time, numpy as np, torch
from kvmgr.transfer.driver import CopyDriver
dev = torch.device('cuda', 0)
src = torch.randint(0, 256, (48, 4096), dtype=torch.uint8, device=dev)
dst = torch.empty((48, 4096), dtype=torch.uint8).pin_memory()
stream = torch.cuda.Stream(dev)
handle, driver = stream.cuda_stream, CopyDriver()
print('driver call from C:', driver._call is not None)
for n in (1, 8, 24, 48, 1, 8, 24, 48):
    table = np.array([[dst.data_ptr() + 4096 * i for i in range(n)], [src.data_ptr() + 4096 * i for i in range(n)], [4096] * n], dtype=np.int64)
    at = [int(table[r].ctypes.data) for r in range(3)]
    times = []
    for _ in range(300):  # one call on an idle stream each
        t0 = time.perf_counter_ns(); driver.batch_at(at[0], at[1], at[2], n, handle, 1); times.append((time.perf_counter_ns() - t0) / 1e3)
        stream.synchronize()
    times.sort()
    print(f'cuMemcpyBatchAsync x{n} (4 KiB, D2H): min {times[0]:.2f} p10 {times[30]:.2f} median {statistics.median(times):.2f} us')
assert torch.equal(dst, src.cpu())
"

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
grep -E "C call:|passed|failed|^device read|^cuMemcpyBatchAsync|^driver call" "$LOG"
grep -E "^=== pieces|host_s|batch_at|descriptor_table|_record|_wait|DmaCopy.issue|device_is_current|_queue|CopyStreams.submit|CudaEngine.submit|Flusher.flush" "$LOG"
grep -E "^=== .* rc=" "$LOG"
