#!/usr/bin/env bash
# Issue 27, helper tidy: `kvmgr bench swap`'s renamed batched column on the H200, from the repo
# root; results under $OUT/tidy/ (log.txt, swap.json). About 1 minute: limits 90 + 60 s.
#  1. `kvmgr bench swap` with `--variants loop batch_c batch_lists` on Qwen, 512 blocks, no
#     step() table: the columns must read loop / batch_c / batch_lists, every row "ok", and
#     whether the driver call is from C shows in step 2.
#  2. The old name: `--variants batch_ctypes` must select batch_c with a FutureWarning in the
#     log ("variant 'batch_ctypes' is now named 'batch_c'"), exit status 0; then the C call
#     module's build (`native_call() is not None`: batch_c is the call from C, else ctypes).
source "${BASH_SOURCE%/*}/_common.sh" tidy
step swap_new 90 python3 -m kvmgr.cli bench swap --geometries qwen --blocks 512 --repeats 5 \
  --warmup 1 --step-swaps 0 --variants loop batch_c batch_lists --json "$D/swap.json"
section swap_new $?
step swap_alias 60 python3 -W default -m kvmgr.cli bench swap --geometries qwen --blocks 64 \
  --repeats 3 --warmup 1 --step-swaps 0 --variants batch_ctypes
section swap_alias $?
step native 30 python3 -c "from kvmgr.transfer.driver_call import native_call; print('batch_c from C:', native_call() is not None)"
section native $?
grep -E "batch_c|batch_lists|is now named|from C" "$LOG" | head -20
