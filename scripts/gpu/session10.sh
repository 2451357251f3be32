#!/usr/bin/env bash
# Round 4, session 10 (issue 27): the figures of the final tree on the H200, from the repo root:
#   bash scripts/gpu/session10.sh      # ~5 minutes; results under $OUT/session10/
# Carry build/bases/1ee9787 (main at the session's start) for the step table's old rows.
# 1. `kvmgr bench swap` step table, 1ee9787 and this tree alternately (twice if time allows):
#    step() host, cuda consecutive (goal <= 150 us) and kernel scattered (goal <= 300 us).
# 2. `kvmgr bench host`: the batched round (goal <= 150 us p50), per-call (<= 1 ms), the steady
#    state's full GCs (0).
# 3. `kvmgr bench peer --halves mla`: the grouped MLA insert eager / host against the C++ op.
# 4. `kvmgr bench mla-insert`: the public function's and the hook's host (goal <= 10 us).
# 5. `kvmgr bench c128`: the gated non-boundary hook step (goal <= 10 us host).
source "${BASH_SOURCE%/*}/_common.sh" session10
source "${BASH_SOURCE%/*}/_step_table.sh"
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
step env 10 python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
step_table_ab "${STEP_BASE:-1ee9787}" 80
step bench_host 70 python3 -m kvmgr.cli bench host --rounds 300 --steps 1000 --json "$D/bench_host.json"
step peer_mla 170 python3 -m kvmgr.cli bench peer --halves mla --mla-json "$D/peer_mla.json"
step mla_insert 70 python3 -m kvmgr.cli bench mla-insert --tokens 1,16,128,512,16384 --reps 15 \
  --json "$D/mla_insert.json"
step c128 60 python3 -m kvmgr.cli bench c128 --batch 1 128 --repeats 7 --steps 100 --json "$D/c128.json"
python3 scripts/gpu/step_summary.py "$D" >>"$LOG" 2>&1 || true
tail -n 120 "$LOG"
