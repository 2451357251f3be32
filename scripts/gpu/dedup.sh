#!/usr/bin/env bash
# GPU checks of the `dedup` round (issue 27, code that reads like its job). Runs from the repo
# root on one H200; writes under $OUT/dedup/. About 3 minutes. Each benchmark below had its code
# split into helpers this round (same rows, same figures expected): one short run each, then
# the GPU tests of the modules they share. Look for "ok" on every line of summary.txt, and in
# duplex.log / mla_insert.log / swap.log / swap_kernel.log / peer.log for rows without "error".
set -uo pipefail
out="${OUT:-/tmp/out}/dedup"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
run() {  # name, seconds, command...: log to $out/name.log, remember a failure, go on
    local name=$1 limit=$2; shift 2
    echo "== $name: $*" | tee -a "$out/summary.txt"
    if timeout "$limit" "$@" >"$out/$name.log" 2>&1; then
        echo "   ok" | tee -a "$out/summary.txt"
    else
        echo "   FAILED (rc $?)" | tee -a "$out/summary.txt"; status=1
    fi
}
# bench/duplex.py -> duplex.py + _duplex_rig.py (_geometry 157 -> 40 lines)
run duplex 60 python3 -m kvmgr.cli bench duplex --geometries qwen --repeats 3 --json "$out/duplex.json"
# bench/mla_insert.py -> + _mla_insert_sets.py; _mla_insert_report.target_rows
run mla_insert 90 python3 -m kvmgr.cli bench mla-insert --tokens 1,64,512,16384 --reps 5 \
    --json "$out/mla_insert.json"
# bench/swap.py _step_case -> _step_round; swap-kernel run -> _measure; _interference._windows
run swap 60 python3 -m kvmgr.cli bench swap --geometries qwen --blocks 64 --repeats 3 \
    --step-swaps 64 --json "$out/swap.json"
run swap_kernel 60 python3 -m kvmgr.cli bench swap-kernel --geometries qwen --blocks 64 \
    --repeats 3 --matmuls 4 --interference-repeats 2 --json "$out/swap_kernel.json"
# bench/peer_mla.py _case -> _step_inputs (bytes_equal must stay true)
# (exit 1 when kvmgr's bytes differ from the C++ op's: the table's "equal" column says NO)
run peer 90 python3 -m kvmgr.cli bench peer --halves mla --mla-tokens 1,16,512 --mla-repeats 5 \
    --mla-json "$out/peer_mla.json"
grep -c '"error"' "$out"/duplex.log "$out"/swap.json "$out"/swap_kernel.json 2>/dev/null \
    | tee -a "$out/summary.txt"
exit $status
