#!/usr/bin/env bash
# GPU checks of round 4 session 5's `shape` helper (issue 27, code that reads like its job), from
# the repo root on one H200, no network; results under $OUT/shape/ (log.txt, two JSON files):
#   bash scripts/gpu/shape.sh        # ~2 minutes
# The c128 and DeepSeek-V4 torch references now share their state write, boundary rule, norm +
# RoPE and FP8 scaling (kvmgr/kernels/c128/reference.py): 1. the c128 tests on the GPU (the
# Triton kernels against those references, poisoned margins, check_slots bounds); 2. a short
# `bench c128` (the gated hook step; its host time should be as in the suite's runs, nothing
# on that path changed) and `bench dsv4 --preset tiny` (it writes state through the references).
source "${BASH_SOURCE%/*}/_common.sh" shape
step env 20 python3 -c "import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, torch.version.cuda, numpy.__version__, torch.cuda.get_device_name())"
step c128_tests 70 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/kernels/test_c128.py
step bench_c128 30 python3 -m kvmgr.cli bench c128 --batch 1 --prefill 128 --repeats 5 --json "$D/c128.json"
step bench_dsv4 30 python3 -m kvmgr.cli bench dsv4 --preset tiny --repeats 3 --json "$D/dsv4.json"
tail -n 40 "$LOG"
