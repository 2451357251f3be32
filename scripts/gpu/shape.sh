#!/usr/bin/env bash
# GPU checks of the `shape` round (issue 27, code that reads like its job). Runs from the repo
# root on one H200 (torch, triton, cuda-python; no network); writes under $OUT/shape/.
# About 3 minutes: the reliability state machine over every CUDA engine (cuda, kernel, auto:
# the same model as the host run in CI, through the testing kit's ScriptedEngine), the GPU
# tests of the modules this round split (c128 bench cases and checks, MLA bench report, the
# copy engines' counters), and one short run of each benchmark whose code moved.
set -uo pipefail
out="${OUT:-/tmp/out}/shape"
mkdir -p "$out"
status=0
run() {  # name, command...: log to $out/name.log, remember a failure, go on
    local name=$1; shift
    echo "== $name: $*" | tee -a "$out/summary.txt"
    if timeout 240 "$@" >"$out/$name.log" 2>&1; then
        echo "   ok" | tee -a "$out/summary.txt"
    else
        echo "   FAILED (rc $?)" | tee -a "$out/summary.txt"; status=1
    fi
}
export KVMGR_STATEFUL_GPU_EXAMPLES=15
run stateful python3 -m pytest -q -x -m gpu tests/manager/test_reliability.py -k "Stateful"
run gpu_tests python3 -m pytest -q -x -m gpu tests/kernels/test_c128.py tests/kernels/test_mla_insert.py \
    tests/transfer/test_cuda_engine.py tests/manager/test_manager_engines.py
run bench_c128 python3 -m kvmgr.cli bench c128 --batch 1 --prefill 128 --repeats 5 \
    --json "$out/c128.json"
run bench_swap_kernel python3 -m kvmgr.cli bench swap-kernel --geometries qwen --blocks 64 \
    --repeats 5 --interference-repeats 2 --json "$out/swap_kernel.json"
run bench_peer_swap python3 -m kvmgr.cli bench peer --halves swap --swap-repeats 5
exit $status
