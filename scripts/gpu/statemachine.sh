#!/usr/bin/env bash
# Issue 27's state machine over every engine on the H200 (helper statemachine), repo root:
#   bash scripts/gpu/statemachine.sh     # ~1-2 minutes; results under $OUT/statemachine/
# tests/manager/test_state_machine.py with a GPU: the real cuda, kernel and auto engines on CUDA
# KV tensors (each under ScriptedEngine(hold=True): 20 derandomized examples of 30 rules), plus
# the CPU specs (no-copy, scripted fault modes, host, cuda on fake CUDA; the fake copy kernel
# skips without the Triton interpreter). Expected: every spec passes; per spec the line
# "<spec>: {batches, bytes, ...}" shows it really copied. Then the kit and layerwise tests the
# branch touched, with their GPU cases.
source "${BASH_SOURCE%/*}/_common.sh" statemachine
step env 20 python3 -c "import sys, torch, hypothesis; print(sys.version.split()[0], torch.__version__, torch.version.cuda, hypothesis.__version__, torch.cuda.get_device_name())"
step state_machine 110 python3 -m pytest -q -s -p no:randomly -p no:cacheprovider \
  tests/manager/test_state_machine.py -W ignore::UserWarning
step kit 40 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/testing/test_testing_kit.py \
  tests/transfer/test_layerwise.py tests/transfer/test_layerwise_gpu.py tests/transfer/test_pinning.py
grep -E "^(null|host|cuda|kernel|auto)[a-z-]*: |passed|failed|error" "$LOG" | tail -n 30
