#!/usr/bin/env bash
# Round 4, session 7 (issue 27): the A/B pairs the helpers' scripts could not run on the device
# (its checkout lacked this session's commits; the step table's old tree lacked the wheels).
# From the repo root, after carrying build/bases/{1c18726,373f872,3c5e150}/kvmgr (~3 MiB each):
#   bash scripts/gpu/session7.sh      # ~4.5 minutes; results under $OUT/session7/
# 1. bench swap's step table, 3c5e150 (before stepcuda2) and this tree alternately, each from its
#    own root: cuda consecutive host <= 150 us, kernel scattered <= 300 us.
# 2. the MLA / c128 GPU tests (mlaloop2's steady paths, first compile included).
# 3. launch_host_pair.py 373f872 (before mlaloop2) against this tree, one process: the serving-loop
#    rows <= 10 us.
# 4. host_pair.py 373f872 (before batched3) and 1c18726 (session 6's start) against this tree:
#    batched grow / full, load, per-call grow-call / full-call.
source "${BASH_SOURCE%/*}/_common.sh" session7
source "${BASH_SOURCE%/*}/_step_table.sh"
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
step env 10 python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
step_table_ab 3c5e150 200
step mla_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_mla_insert.py \
  tests/kernels/test_c128.py tests/kernels/test_launch.py -k "gpu or steady or checked or turned_off"
for rev in 373f872 1c18726; do
  OLD=$(mktemp -d)
  if base_tree "$rev" "$OLD"; then
    [ "$rev" = 373f872 ] && step launch_host_pair 25 python3 scripts/launch_host_pair.py "$OLD" \
      --tokens 1,16,128 --rounds 30 --json "$D/launch_host_pair.json"
    step "host_pair_$rev" 40 python3 scripts/host_pair.py "$OLD" --rounds 400 --modes grow full \
      --json "$D/host_pair_$rev.json"
    step "host_pair_call_$rev" 40 python3 scripts/host_pair.py "$OLD" --rounds 100 \
      --modes load grow-call full-call --json "$D/host_pair_call_$rev.json"
  else
    echo "no tree for $rev: its pairs skipped" | tee -a "$LOG"
  fi
  rm -rf "$OLD"
done
tail -n 60 "$LOG"
