#!/usr/bin/env bash
# Round 4, session 8 (issue 27): the launch-stack figures on the final tree, from the repo root:
#   bash scripts/gpu/session8.sh      # ~4 minutes; results under $OUT/session8/
# 1. `kvmgr bench peer --halves mla`: the grouped MLA insert eager / host / graph against the
#    C++ op built after the seed PR, same process (goal: no slower in every row).
# 2. `kvmgr bench mla-insert`: host of the public function and of the hook (goal <= 10 us).
# 3. `kvmgr bench c128`: the gated non-boundary hook step (goal <= 10 us host).
source "${BASH_SOURCE%/*}/_common.sh" session8
step env 10 python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
step peer_mla 170 python3 -m kvmgr.cli bench peer --halves mla --mla-json "$D/peer_mla.json"
step mla_insert 70 python3 -m kvmgr.cli bench mla-insert --tokens 1,16,128,512,16384 --reps 15 \
  --json "$D/mla_insert.json"
step c128 60 python3 -m kvmgr.cli bench c128 --batch 1 128 --repeats 7 --steps 100 --json "$D/c128.json"
tail -n 80 "$LOG"
