#!/usr/bin/env bash
# Round 4 session 10: the MLA insert and c128 hosts of two trees in one call (build/bases/1ee9787
# and build/bases/now carried), in turn, twice; ~2 minutes. Results under $OUT/launchab/.
source "${BASH_SOURCE%/*}/_common.sh" launchab
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
for run in 1 2; do
  for tree in 1ee9787 now; do
    root=$(mktemp -d); cp -r "build/bases/$tree/kvmgr" "$root/"
    step "c128_${tree}_$run" 40 bash -c "cd '$root' && PYTHONPATH='$SITE_PATH$root' python3 -m kvmgr.cli bench c128 --batch 1 128 --repeats 7 --steps 100 2>&1 | grep -E 'hook step|tiny torch'"
    step "mla_${tree}_$run" 40 bash -c "cd '$root' && PYTHONPATH='$SITE_PATH$root' python3 -m kvmgr.cli bench mla-insert --tokens 1,16,128,512 --reps 15 2>&1 | grep -E 'host (grouped|hook)'"
    rm -rf "$root"
  done
done
grep -v "^\.\.\." "$LOG"
