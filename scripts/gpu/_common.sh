# The shared start of the scripts/gpu/<name>.sh sections, sourced from the repo root:
#   source "${BASH_SOURCE%/*}/_common.sh" NAME
# Sets D (the section's folder: $OUT/NAME, or $OUT itself when it already ends in /NAME, as
# scripts/gpu_round4.sh passes it) and LOG ($D/log.txt); puts the repo first on PYTHONPATH; and
# defines
#   step NAME SECONDS CMD...  run CMD under a time limit, its output appended to $LOG between
#                             "=== NAME" lines that end with its exit status;
#   section NAME RC           append {"section": NAME, "rc": RC} to $D/sections.jsonl.
set -u
OUT=${OUT:-out}
case "$OUT" in */"$1") D=$OUT ;; *) D=$OUT/$1 ;; esac
mkdir -p "$D"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$D/log.txt"
step() { local name=$1 secs=$2; shift 2; echo "=== $name ($(date -u +%T))" | tee -a "$LOG"
  timeout "$secs" "$@" >>"$LOG" 2>&1; echo "=== $name rc=$?" | tee -a "$LOG"; }
# base_tree REV DIR: the kvmgr package of revision REV into DIR (DIR/kvmgr): from
# build/bases/REV/kvmgr when the caller carried it there (the device's checkout may lack new
# commits), else with git archive; returns non-zero if neither has it.
base_tree() { if [ -d "build/bases/$1/kvmgr" ]; then cp -r "build/bases/$1/kvmgr" "$2/"
  else git archive "$1" kvmgr 2>/dev/null | tar -x -C "$2" 2>/dev/null; fi; [ -d "$2/kvmgr" ]; }
# the wheel folder's site (scripts/gpu/_session.sh installs it), for a PYTHONPATH set by hand
SITE_PATH=$([ -d /tmp/site ] && echo "/tmp/site:" || true)
section() { echo "{\"section\": \"$1\", \"rc\": $2}" | tee -a "$D/sections.jsonl"; }
# host_pair_ab REV: scripts/host_pair.py of the tree of REV (base_tree) against this checkout,
# three runs (grow/full/load 300 rounds, grow/full 300, the per-call rows 60), JSON into $D.
host_pair_ab() { local base run name rounds modes; base=$(mktemp -d)
  if base_tree "$1" "$base"; then
    for run in host_pair:300:grow,full,load host_pair_2:300:grow,full host_pair_call:60:grow-call,full-call; do
      IFS=: read -r name rounds modes <<< "$run"
      step "$name" 40 python3 scripts/host_pair.py "$base" --rounds "$rounds" \
        --modes ${modes//,/ } --json "$D/$name.json" || echo "$name failed: see above" | tee -a "$LOG"
    done
  else echo "no tree for $1: see above" | tee -a "$LOG"; fi
  rm -rf "$base"; }
