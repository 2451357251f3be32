#!/usr/bin/env bash
# Issue 27, round 4 session 15, helper hostpath15: (1) add_absent's prefetch follows each key's
# probes (kvmgr/_index_c.py: up to 8 index slots and their entries a key, not the first only);
# (2) CopyStreams' device check reads the driver's current context from C and compares it with
# the device's primary context (kvmgr/transfer/cuda_current.device_check) instead of torch's
# _cuda_getDevice (9 us median in the H100 step, session 13). On the GPU host, from the repo
# root; results under $OUT/hostpath15/ (log.txt, step_{old,new}_{1,2}.json, round_ab.json,
# cost_ab.json, pieces_cuda.json). About 3 minutes: limits 20 + 2 x 30 (+ 2 x 20 if under 90 s
# have passed) + 40 + 20 + 20 + 30 + 20 s.
# Old tree = cc05b07 (main at the session's start; carry build/bases/cc05b07, made with
# `mkdir -p build/bases/cc05b07 && git archive cc05b07 kvmgr | tar -x -C build/bases/cc05b07`;
# STEP_BASE overrides); new tree = this checkout; each tree's bench from its own root.
#  1. The versions (python, torch, the GPU).
#  2. `kvmgr bench swap` step table, old and new in turn, two rounds: step() host for 512 queued
#     one-block stores of 48 x 4 KiB pages, cuda consecutive (goal <= 150 us; H100 201-269 at
#     the session's start) and kernel scattered (goal <= 300 us).
#  3. The GPU tests of the device check (driver context vs torch's reader, forked child) and
#     of the C index passes.
#  4. scripts/round_step_ab.py (the batched round, both trees in ONE process; goal <= 150 us p50,
#     H100 159 us), scripts/add_absent_ab.py (the index pass alone, one process) and
#     scripts/step_cost_ab.py (kvmgr's Python share of the step, fake CUDA, one process).
#  5. scripts/step_pieces.py with the real cuda engine: CopyStreams._is_current (the new check)
#     among the pieces, against device_is_current's 9 us median in session 13.
source "${BASH_SOURCE%/*}/_common.sh" hostpath15
source "${BASH_SOURCE%/*}/_step_table.sh"
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
BASE=${STEP_BASE:-cc05b07}

step env 20 python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"

step_table_ab "$BASE" 90

step tests 40 python3 -m pytest -q -x -p no:randomly -p no:cacheprovider \
  tests/transfer/test_cuda_current.py tests/transfer/test_driver_call.py tests/scheduler/test_index_c.py

OLD=$(mktemp -d)
if base_tree "$BASE" "$OLD"; then
  step round_ab 20 python3 scripts/round_step_ab.py --old "$BASE" --rounds 600 --json "$D/round_ab.json"
  step index_ab 20 python3 scripts/add_absent_ab.py --old "$OLD" --calls 400
  step cost_ab 30 python3 scripts/step_cost_ab.py --old "$BASE" --repeats 150 --json "$D/cost_ab.json"
else
  echo "no tree for $BASE: round_step_ab, add_absent_ab and step_cost_ab skipped" | tee -a "$LOG"
fi
rm -rf "$OLD"

step pieces_cuda 20 python3 scripts/step_pieces.py --engine cuda --repeats 60 --json "$D/pieces_cuda.json"

echo "=== hostpath15 summary (base $BASE)"
python3 scripts/gpu/step_summary.py "$D"
grep -E "^\| (grow|full) \| (host|step|round|calls) " "$LOG"
grep -E "^add_absent " "$LOG"
grep -E "^(cuda|kernel) " "$LOG" | grep -E " host | cpu "
grep -E "passed|failed" "$LOG"
grep -E "host_s|_is_current|device_is_current|Flusher.flush" "$LOG"
grep -E "^=== .* rc=" "$LOG"
