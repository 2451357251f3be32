#!/usr/bin/env bash
# Issue 27's host-path figures on the H200 (helper hostpath), from the repo root, no network:
#   bash scripts/gpu/hostpath.sh        # ~2 minutes; results under $OUT/hostpath/ (3 files)
# 1. `kvmgr bench swap --blocks 512`: the step() table (512 queued one-block stores of 48 x 4 KiB
#    pages; host = StepReport.host_s, its manager and engine shares) for the cuda engine
#    (consecutive ids: target 150 us) and the kernel engine (scattered ids: target 300 us),
#    plus the copy columns of the qwen geometry at 512 blocks.
# 2. `kvmgr bench host`: 512 one-block stores batched / per call and the steady state (full GCs)
#    on the H200 host's CPU (targets: batched round 150 us, per call 1 ms, no full GC).
source "${BASH_SOURCE%/*}/_common.sh" hostpath
step env 20 python3 -c "import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, torch.version.cuda, numpy.__version__, torch.cuda.get_device_name())"
step bench_swap 100 python3 -m kvmgr.cli bench swap --geometries qwen --blocks 512 --repeats 10 \
  --warmup 3 --step-swaps 512 --step-engines cuda kernel --json "$D/bench_swap.json"
step bench_host 70 python3 -m kvmgr.cli bench host --rounds 200 --steps 1000 --json "$D/bench_host.json"
tail -n 40 "$LOG"
