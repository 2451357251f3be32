#!/usr/bin/env bash
# Issue 27, step() host time after the driver's copy and event calls from C (helper stepcuda3),
# on the H200, from the repo root; results under $OUT/stepcuda3/ (log.txt,
# step_{old,new}_{1,2}.json, pieces_{c,ctypes,kernel}.json). About 2-2.5 minutes: limits
# 20 + 2 x 30 + 2 x 20 + 35 + 20 + 3 x 20 s (the second round of section 2 runs only if under
# 45 s have passed; each bench run is 10-15 s).
# Old tree = main just before this branch's first merge into it (the first parent of "Merge
# branch 'stepcuda3'"; before any merge, the branch point 6e89bb2; else `git merge-base HEAD
# main`), extracted with git archive (or carried in build/bases/REV); new tree = this checkout;
# each tree's bench from its own root with PYTHONPATH set to that root only.
#  1. The versions (python, torch, the GPU) and whether the C call module builds here.
#  2. `kvmgr bench swap` step table: 512 queued one-block stores of 48 x 4 KiB pages, cuda engine
#     on consecutive ids (target step() host <= 150 us; last 258 / 366) and kernel engine on
#     scattered ids (target <= 300 us; last 302 / 432); old and new alternately, twice if time
#     allows. Look at the summary: host / manager / engine per tree and new/old ("engine" holds
#     the driver call and the events).
#  3. The GPU tests of what changed: tests/transfer/test_driver_call.py (the C call's arguments,
#     CopyDriver from C and through ctypes), test_cuda_current.py (event_calls: a side stream
#     ordered after the current one through the driver's record/wait from C), test_cuda_engine.py
#     (the real driver's copies from C; a store after a kernel, three rounds: the fence and
#     events of rounds 1-2 on the driver path). An event test failing here: revert 1dc4102 and
#     ff7d31e (DriverEvents; torch's C methods stay).
#  4. cuMemcpyBatchAsync on the H200 (48 descriptors of 4 KiB, device -> pinned, on a copy
#     stream, 400 calls each on an idle stream: min / p10 / median): through ctypes and from C;
#     cuMemcpyAsync the same; an event record and a wait (hot loop, best of 5 x 2000) through
#     torch's C methods and through the driver from C (DriverEvents).
#  5. scripts/step_pieces.py, cuda engine, from C and without (KVMGR_NATIVE_LAUNCH=0: the driver
#     call through ctypes, the events through torch's C methods), then the kernel engine: pieces
#     (CopyDriver.batch_at, the event records/waits "CopyStreams._record (event)", DmaCopy.issue,
#     CopyStreams.submit, flush) min / p10 / median us.
source "${BASH_SOURCE%/*}/_common.sh" stepcuda3
source "${BASH_SOURCE%/*}/_step_table.sh"
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
BASE=${STEP_BASE:-$(branch_base stepcuda3 6e89bb2)}  # STEP_BASE overrides; main just before its first merge, else 6e89bb2

step env 20 python3 -c "import sys, torch; from kvmgr.transfer.driver_call import native_call; \
print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(), 'C call:', native_call())"

step_table_ab "$BASE" 45

step gpu_tests 35 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/transfer/test_driver_call.py \
  tests/transfer/test_cuda_current.py tests/transfer/test_cuda_engine.py

step driver_call_cost 20 python3 -c "
import timeit, numpy as np, torch
from kvmgr.transfer.driver import CopyDriver
dev = torch.device('cuda', 0)
src = torch.randint(0, 256, (48, 4096), dtype=torch.uint8, device=dev)
dst = torch.empty((48, 4096), dtype=torch.uint8).pin_memory()
table = np.array([[src.data_ptr() + 4096 * i for i in range(48)], [dst.data_ptr() + 4096 * i for i in range(48)], [4096] * 48], dtype=np.int64)
stream = torch.cuda.Stream(dev)
handle = stream.cuda_stream
import statistics, time
for name, from_c in (('ctypes', False), ('from C', True), ('ctypes', False), ('from C', True)):
    driver = CopyDriver(from_c=from_c)
    assert (driver._call is not None) is from_c, 'the C module did not build'
    at = [int(table[r].ctypes.data) for r in (1, 0, 2)]
    batch = lambda: driver.batch_at(at[0], at[1], at[2], 48, handle, 1)
    copy = lambda: driver.memcpy(dst.data_ptr(), src.data_ptr(), 4096, handle)
    for what, fn in (('cuMemcpyBatchAsync x48', batch), ('cuMemcpyAsync', copy)):
        times = []
        for _ in range(400):  # one call on an idle stream each (a full queue would time the GPU)
            t0 = time.perf_counter_ns(); fn(); times.append((time.perf_counter_ns() - t0) / 1e3)
            stream.synchronize()
        times.sort()
        print(f'driver call {what} {name}: min {times[0]:.2f} p10 {times[40]:.2f} median {statistics.median(times):.2f} us')
assert torch.equal(dst, src.cpu())
from kvmgr.transfer.cuda_current import event_calls
event, other = torch.cuda.Event(), torch.cuda.Event(enable_timing=True, blocking=True)
event.record(stream); other.record(stream); stream.synchronize()  # made by torch
base = torch._C._CudaEventBase
driver_record, driver_wait = event_calls(True)
print('event calls:', driver_record)
for name, record, wait in (('torch C', base.record, base.wait), ('driver from C', driver_record, driver_wait)) * 2:
    for what, fn in (('record', lambda: record(other, stream)), ('wait', lambda: wait(event, stream))):
        best = min(timeit.repeat(fn, number=2000, repeat=5)) / 2000 * 1e6
        print(f'event call {what} {name}: {best:.2f} us')
stream.synchronize()
"

step pieces_c 20 python3 scripts/step_pieces.py --engine cuda --repeats 60 --json "$D/pieces_c.json"
step pieces_ctypes 20 env KVMGR_NATIVE_LAUNCH=0 python3 scripts/step_pieces.py --engine cuda --repeats 60 --json "$D/pieces_ctypes.json"
step pieces_kernel 20 python3 scripts/step_pieces.py --engine kernel --repeats 60 --json "$D/pieces_kernel.json"

echo "=== stepcuda3 summary (base $BASE)"
python3 scripts/gpu/step_summary.py "$D"
grep -E "C call:|passed|failed|^driver call|^event call" "$LOG"
grep -E "host_s|batch_at|_record|_wait|DmaCopy.issue|CopyStreams.submit|Flusher.flush|KernelCopy" "$LOG"
grep -E "^=== .* rc=" "$LOG"
