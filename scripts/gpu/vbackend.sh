#!/usr/bin/env bash
# vLLM backend (issue 22 part 3) on an H200: kvmgr's OffloadingWorker with CUDA KV tensors and
# each CUDA engine (auto, cuda, kernel): stores coalesced into one D2H batch, loads into H2D
# batches (expedited first), bytes compared. Needs vLLM importable (the worker subclasses its
# OffloadingWorker); without it the test module skips and the log says so. ~1 minute.
# Run: bash scripts/gpu_round4.sh vbackend
set -uo pipefail
out="${OUT:-out/vbackend}"  # scripts/gpu_round4.sh passes OUT=$OUT/vbackend
mkdir -p "$out"
{
    python3 -c "import vllm, sys; print('vllm', vllm.__version__)" 2>&1 | tail -1
    python3 -m pytest -q -rs -p no:randomly -m gpu tests/integrations/vllm/test_vllm_backend_worker.py 2>&1 | tail -15
} > "$out/worker_gpu.txt"
cat "$out/worker_gpu.txt"
