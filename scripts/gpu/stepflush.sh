#!/usr/bin/env bash
# Issue 27, step() host time after the engine-independent flush cuts (helper stepflush): the
# moved-tensor check's pointers in the guard's C call (kvmgr/_native.py), find_runs' checks and
# stable sort and one run's descriptors in C (kvmgr/transfer/_plan_c.py), the worker's submit in
# one frame. On the H200, from the repo root; results under $OUT/stepflush/ (log.txt,
# step_{old,new}_{1,2}.json, pieces_{cuda,kernel,numpy}.json). About 2-2.5 minutes: limits 20 +
# 2 x 30 (+ 2 x 20 if under 50 s have passed) + 40 + 3 x 20 s; each bench run is 10-15 s.
# Old tree = main just before this branch's first merge into it (else the branch point 51e895a,
# carried in build/bases/51e895a), extracted with git archive; new tree = this checkout; each
# tree's bench from its own root with PYTHONPATH set to that root only.
#  1. The versions and whether kvmgr's C modules build here (kvmgr_fire: the guard's pointers;
#     kvmgr_plan: sort_pairs / fill_run); this also compiles them into Triton's cache once, so
#     the timed runs below do not pay the build.
#  2. `kvmgr bench swap` step table: 512 queued one-block stores of 48 x 4 KiB pages, cuda engine
#     on consecutive ids (target step() host <= 150 us; last 202-341) and kernel engine on
#     scattered ids (target <= 300 us; last 229-399); old and new alternately, twice if time
#     allows. The summary: host / manager / plan / engine per tree and new / old.
#  3. GPU tests of what changed: tests/manager/test_tensor_guard.py (cuda tensors: every move
#     reported, through the C pointer read and through Python), tests/transfer/test_plan_c.py
#     (the C plan arithmetic against numpy), tests/transfer/test_cuda_engine.py and
#     tests/transfer/test_plan.py (real copies of plans built through the C calls),
#     tests/kernels/test_launch.py (the launch module's new home). A failure in the plan tests:
#     revert the _plan_c commits (find_runs_numpy and the np.dot fill stay the paths).
#  4. scripts/step_pieces.py with the real engines: cuda, kernel, and cuda with
#     KVMGR_NATIVE_LAUNCH=0 (no C module at all: the numpy plan, the Python pointer reads, the
#     driver through ctypes): TensorGuard.moved, build_plan, find_runs, descriptor_table,
#     Flusher.flush min / p10 / median us.
source "${BASH_SOURCE%/*}/_common.sh" stepflush
source "${BASH_SOURCE%/*}/_step_table.sh"
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
BASE=${STEP_BASE:-$(branch_base stepflush 51e895a)}  # STEP_BASE overrides

step env 20 python3 -c "import sys, torch; from kvmgr import _native; from kvmgr.transfer import _plan_c; \
print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(), 'kvmgr_fire:', _native.c_module(), \
'pointers:', _native.checked_data_ptrs(), 'kvmgr_plan:', _plan_c.sort_pairs(), _plan_c.fill_run())"

step_table_ab "$BASE" 50

step gpu_tests 40 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/manager/test_tensor_guard.py \
  tests/transfer/test_plan_c.py tests/transfer/test_plan.py tests/transfer/test_cuda_engine.py tests/kernels/test_launch.py

step pieces_cuda 20 python3 scripts/step_pieces.py --engine cuda --repeats 60 --json "$D/pieces_cuda.json"
step pieces_kernel 20 python3 scripts/step_pieces.py --engine kernel --repeats 60 --json "$D/pieces_kernel.json"
step pieces_numpy 20 env KVMGR_NATIVE_LAUNCH=0 python3 scripts/step_pieces.py --engine cuda --repeats 60 --json "$D/pieces_numpy.json"

echo "=== stepflush summary (base $BASE)"
python3 scripts/gpu/step_summary.py "$D"
grep -E "kvmgr_fire:|passed|failed" "$LOG"
grep -E "host_s|TensorGuard.moved|build_plan|find_runs|descriptor_table|CudaEngine.submit|Flusher.flush|KernelCopy" "$LOG"
grep -E "^=== .* rc=" "$LOG"
