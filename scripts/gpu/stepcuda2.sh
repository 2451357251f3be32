#!/usr/bin/env bash
# Issue 27, step() host time after the moved-tensor check's C++ fast path (helper stepcuda2),
# on the H200, from the repo root; results under $OUT/stepcuda2/ (log.txt,
# step_{old,new}_{1,2}.json, pieces.json). About 2 minutes: limits 10 + 2 x 30 + 2 x 20 + 25 +
# 15 + 30 s (the second round of section 2 runs only if under 50 s have passed; each run is 10-15 s).
# Old tree = main just before this branch's first merge into it (the first parent of
# "Merge branch 'stepcuda2'"; before any merge, the branch point 3c5e150; else `git merge-base
# HEAD main`), extracted with git archive; new tree = this checkout. Each tree's bench runs from its own
# root with PYTHONPATH set to that root only (`python3 -m` puts the working directory first on
# sys.path: run from this checkout, the old tree's run would import the new kvmgr).
#  1. The versions (python, torch, the GPU).
#  2. `kvmgr bench swap` step table: 512 queued one-block stores of 48 x 4 KiB pages, cuda engine
#     on consecutive ids (target step() host <= 150 us; last measured 236) and kernel engine on
#     scattered ids (target <= 300 us; last 295); old and new alternately, twice if time allows.
#     Look at the summary: host / manager / engine per tree and new/old (the guard is in
#     "manager").
#  3. The moved-tensor tests on CUDA tensors (tests/manager/test_tensor_guard.py, the cuda
#     cases: every move in every grad mode, the rebuild after a mode change) and the 48-tensor
#     check's time on CUDA tensors: moved() (C++ check + pointers) against the four-list compare.
#  4. What the streams' per-batch torch calls cost on the H200 host (hot loop, best of 5): an
#     event record on the current stream (torch's Python wrapper builds a Stream) against one on
#     a given stream or through torch's C base, wait_event, current_device, cuda_stream: for
#     the next cut of CopyStreams.submit (none was made here without these figures).
#  5. scripts/step_pieces.py on the H200 (this tree, real engines and driver): min / p10 / median
#     us of each piece of the step (flush, take, moved, launch, plan, engine submit, DMA issue,
#     descriptor table, driver call, queueing): where the remaining host time goes.
source "${BASH_SOURCE%/*}/_common.sh" stepcuda2
source "${BASH_SOURCE%/*}/_step_table.sh"
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
BASE=$(branch_base stepcuda2 3c5e150)  # main just before its first merge, else 3c5e150

step env 10 python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"

step_table_ab "$BASE" 50

step guard_tests 25 bash -c "python3 -m pytest -q -p no:randomly -k cuda tests/manager/test_tensor_guard.py && \
  python3 -c \"
import timeit, torch
from kvmgr.worker.tensors import TensorGuard
kv = [torch.empty((1025, 4096), dtype=torch.uint8, device='cuda') for _ in range(48)]
guard = TensorGuard(kv)
assert guard.moved() is None and guard._check is not None and guard._check.check(*kv)
for name, fn in (('moved (C++ check + pointers)', guard.moved), ('four-list compare', guard._compare)):
    best = min(timeit.repeat(fn, number=2000, repeat=5)) / 2000 * 1e6
    print(f'48 CUDA tensors, {name}: {best:.1f} us')
\""

step event_costs 15 python3 -c "
import timeit, torch
dev = torch.device('cuda', 0)
side = torch.cuda.Stream(dev)
event, other = torch.cuda.Event(), torch.cuda.Event(enable_timing=True, blocking=True)
event.record(); other.record(side); torch.cuda.synchronize()
base_record = torch._C._CudaEventBase.record
cases = {
    'Event.record() (current stream: builds a Stream)': lambda: event.record(),
    'torch.cuda.current_stream()': lambda: torch.cuda.current_stream(),
    'Event.record(stream)': lambda: other.record(side),
    '_CudaEventBase.record(event, stream)': lambda: base_record(other, side),
    'Stream.wait_event(event)': lambda: side.wait_event(event),
    'torch.cuda.current_device()': lambda: torch.cuda.current_device(),
    'torch._C._cuda_getDevice()': lambda: torch._C._cuda_getDevice(),
    'stream.cuda_stream': lambda: side.cuda_stream,
}
for name, fn in cases.items():
    best = min(timeit.repeat(fn, number=2000, repeat=5)) / 2000 * 1e6
    print(f'event cost {name}: {best:.2f} us')
torch.cuda.synchronize()
"

step pieces 30 python3 scripts/step_pieces.py --repeats 100 --json "$D/pieces.json"

echo "=== stepcuda2 summary (base $BASE)"
python3 scripts/gpu/step_summary.py "$D"
grep -E "48 CUDA tensors|passed|failed|^event cost" "$LOG"
sed -n '/^=== pieces (/,/^=== pieces rc=/p' "$LOG"
grep -E "^=== .* rc=" "$LOG"
