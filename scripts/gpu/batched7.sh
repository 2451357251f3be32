#!/usr/bin/env bash
# Issue 27's batched host round on the H200 host's CPU (helper batched7: a store's per-key
# passes in one C loop each, kvmgr/_index_c.py: check_keys' bytes pass, the increasing-ids
# check, the index inserts with the index's table prefetched, the LRU's key_of writes, the
# eviction path's index updates and deletes), from the repo root, no network, no GPU needed
# (NullEngine), ~25 s on a quiet machine, 2.5 minutes at most:
#   bash scripts/gpu/batched7.sh        # results under $OUT/batched7/
# Carry build/bases/1ee9787 (main before this work: `mkdir -p build/bases/1ee9787 && git
# archive 1ee9787 kvmgr | tar -x -C build/bases/1ee9787`) when the checkout may lack it.
# 0. whether the C module builds there (Triton's compiler; without it every row is the Python
#    path, as CI's: then look only at "c_module" in the log).
# 1. scripts/host_pair.py between 1ee9787 and this tree, paired round by round: one store_many
#    of 512 one-block keys + step() + completion with room (grow: the goal row, <= 150 us; 181
#    min / 223 p50 us on the H200 host at 1ee9787; calls 141 us of it), into a full LRU tier
#    (full), loads (load); then the per-call rows (grow-call, full-call: must not be slower).
#    Look at "new / old" (2-core VM: grow 0.77-0.80, full 0.85-0.97, load 0.94-0.98,
#    per-call 0.97-1.01) and the new grow p50, min and calls.
# 2. `kvmgr bench host --rounds 200 --steps 1000`: every row and the steady state, GC on.
source "${BASH_SOURCE%/*}/_common.sh" batched7
step uptime 5 uptime
step c_module 60 python3 -c "import torch; from kvmgr._index_c import index_c; print('c_module', index_c())"
host_pair_ab 1ee9787  # host_pair.py of the base against this tree, 3 runs
step bench_host 50 python3 -m kvmgr.cli bench host --rounds 200 --steps 1000 --json "$D/bench_host.json"
tail -n 40 "$LOG"
