#!/usr/bin/env bash
# Issue 27's batched host round on the H200 host's CPU (helper batched6: the index's values
# from int objects made once, slices for a store on a run of fresh CPU blocks, no distinct
# test for strictly increasing GPU ids), from the repo root, no network, no GPU needed
# (NullEngine), ~20 s on a quiet machine, 2 minutes at most:
#   bash scripts/gpu/batched6.sh        # results under $OUT/batched6/
# Carry build/bases/42ae48b (main before this work: `mkdir -p build/bases/42ae48b && git
# archive 42ae48b kvmgr | tar -x -C build/bases/42ae48b`) when the checkout may lack it.
# 1. scripts/host_pair.py between 42ae48b and this tree, paired round by round: one store_many
#    of 512 one-block keys + step() + completion with room (grow: the goal row, <= 150 us; 181
#    min / 223 p50 us on the H200 host at 42ae48b), into a full LRU tier (full), loads (load);
#    then the per-call rows (grow-call, full-call: must not be slower). Look at "new / old"
#    (2-core VM: grow 0.87-0.96, full 0.92-0.99, load 0.92-0.96, per-call 0.97-0.98) and the
#    new grow p50 and min.
# 2. `kvmgr bench host --rounds 200 --steps 1000`: every row and the steady state, GC on.
source "${BASH_SOURCE%/*}/_common.sh" batched6
step uptime 5 uptime
host_pair_ab 42ae48b  # host_pair.py of the base against this tree, 3 runs
step bench_host 50 python3 -m kvmgr.cli bench host --rounds 200 --steps 1000 --json "$D/bench_host.json"
tail -n 40 "$LOG"
