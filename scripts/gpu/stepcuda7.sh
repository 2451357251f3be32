#!/usr/bin/env bash
# Issue 27, step() host time: the moved check through torch's C shim, and the opt-in
# completion="host_func" (helper stepcuda7), on the H200, from the repo root; results under
# $OUT/stepcuda7/ (log.txt, step_{old,new,hostfunc}_{1,2}.json, pieces_{queue,host_func}.json).
# About 2-2.5 minutes: limits 15 + 60 + 3 x 30 (+ 3 x 20 for a second round, only if under 70 s
# have passed) + 20 + 2 x 15 s; each bench run is 10-15 s.
# Old tree = main at 6a1cf30 (the start of round 4 session 11; build/bases/6a1cf30 if carried,
# else git archive; STEP_BASE overrides), new tree = this checkout.
#  1. The versions, whether the C call module builds.
#  2. GPU tests. Default completion: test_tensor_guard.py (every move of CUDA KV tensors reported
#     through the shim check too), test_guard_shim.py, test_host_wake.py (its GPU test: a store
#     behind a 50 ms kernel under completion="host_func", bytes, eventfds closed). Then
#     KVMGR_COMPLETION=host_func: test_cuda_engine.py, test_stream_timing.py,
#     test_layerwise_gpu.py (every real engine of those files on host-function completion). A
#     failure under host_func: leave KVMGR_COMPLETION unset (the default is unchanged).
#  3. `kvmgr bench swap` step table (512 queued one-block stores of 48 x 4 KiB pages; cuda engine
#     on consecutive ids, target step() host <= 150 us, last 170-297; kernel engine scattered,
#     target <= 300 us): old tree, this tree (default completion "queue"), this tree with
#     KVMGR_COMPLETION=host_func ("hostfunc"), in turn, twice if time allows. The summary
#     prints new / old (the shim check: expect the moved check's ~21 us to drop to a few) and
#     hostfunc / new (the wake: expect the 12-27 us of the queue put's wake to go, less the cost
#     of one cuLaunchHostFunc, measured in step 4).
#  4. Micro (best of 5 x 2000, us a call): SimpleQueue.put to a thread asleep in get (what each
#     submit pays now) against cuLaunchHostFunc from C (the host function writing an eventfd
#     nobody reads), on an idle copy stream.
#  5. scripts/step_pieces.py, real cuda engine, this tree, --completion queue then host_func:
#     CopyStreams._queue, HostFuncInbox.put, TensorGuard.moved, host_s (min / p10 / median).
source "${BASH_SOURCE%/*}/_common.sh" stepcuda7
source "${BASH_SOURCE%/*}/_step_table.sh"
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
BASE=${STEP_BASE:-6a1cf30}

env_step 15

step gpu_tests 30 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/manager/test_tensor_guard.py \
  tests/manager/test_guard_shim.py tests/transfer/test_host_wake.py
step gpu_tests_host_func 30 env KVMGR_COMPLETION=host_func python3 -m pytest -q -p no:randomly -p no:cacheprovider \
  tests/transfer/test_cuda_engine.py tests/transfer/test_stream_timing.py tests/transfer/test_layerwise_gpu.py

ARGS="--geometries qwen --blocks 64 --variants none --repeats 10 --warmup 3 --step-swaps 512 --step-engines cuda kernel"
OLD_TREE=$(mktemp -d)
base_tree "$BASE" "$OLD_TREE" || { echo "no old tree: its rows are skipped" | tee -a "$LOG"; OLD_TREE=""; }
for run in 1 2; do
  [ "$run" = 2 ] && [ "$SECONDS" -gt 70 ] && { echo "second round skipped (time)" | tee -a "$LOG"; break; }
  limit=$((run == 1 ? 30 : 20))
  [ -n "$OLD_TREE" ] && step "step_old_$run" $limit bash -c "cd '$OLD_TREE' && PYTHONPATH='$SITE_PATH$OLD_TREE' \
    python3 -m kvmgr.cli bench swap $ARGS --json '$D/step_old_$run.json'"
  step "step_new_$run" $limit bash -c "PYTHONPATH='$SITE_PATH$PWD' python3 -m kvmgr.cli bench swap $ARGS \
    --json '$D/step_new_$run.json'"
  step "step_hostfunc_$run" $limit bash -c "KVMGR_COMPLETION=host_func PYTHONPATH='$SITE_PATH$PWD' \
    python3 -m kvmgr.cli bench swap $ARGS --json '$D/step_hostfunc_$run.json'"
done
[ -n "$OLD_TREE" ] && rm -rf "$OLD_TREE"

step wake_micro 20 python3 -c "
import os, queue, threading, time, torch
from kvmgr.transfer import _host_wake
stream = torch.cuda.Stream(torch.device('cuda', 0))
inbox = queue.SimpleQueue()
threading.Thread(target=lambda: [None for _ in iter(inbox.get, None)], daemon=True).start()
launch, callback = _host_wake.host_func_launcher(), _host_wake.wake_address()
print('launcher', launch is not None, 'callback', callback is not None)
target = _host_wake._module().target(os.eventfd(0, os.EFD_NONBLOCK))  # what the host function writes
calls = {'put': lambda: inbox.put(1), 'launch': lambda: launch(stream.cuda_stream, callback, target)}
best = {name: [] for name in calls}
for _ in range(5):
    for name, fn in calls.items():
        times = []
        for _ in range(2000):
            time.sleep(0.0002)  # the thread asleep again, the stream idle
            t0 = time.perf_counter_ns(); fn(); times.append((time.perf_counter_ns() - t0) / 1e3)
        times.sort()
        best[name].append((times[0], times[200], times[1000]))
stream.synchronize()
for name, rows in best.items():
    print(f'wake micro {name}: min / p10 / median us', min(rows))
inbox.put(None)
"

step pieces_queue 15 python3 scripts/step_pieces.py --engine cuda --repeats 40 --completion queue --json "$D/pieces_queue.json"
step pieces_host_func 15 python3 scripts/step_pieces.py --engine cuda --repeats 40 --completion host_func \
  --json "$D/pieces_host_func.json"

echo "=== stepcuda7 summary (base $BASE)"
python3 scripts/gpu/step_summary.py "$D"
grep -E "C call:|passed|failed|^wake micro|^launcher" "$LOG"
grep -E "^=== pieces|completion|host_s|TensorGuard.moved|build_plan|_queue|HostFuncInbox.put|CopyStreams.submit|Flusher.flush" "$LOG"
grep -E "^=== .* rc=" "$LOG"
