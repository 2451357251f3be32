#!/usr/bin/env bash
# Issue 27, step() host time below the scheduler (helper stepplan), on the H200, from the repo
# root; writes under $OUT/stepplan/. About 2.5 minutes (limits 50 + 2-4 x 25 + 20 + 2 x 10 s;
# the second round of section 2 runs only if less than 60 s have passed); each section has its
# own time limit and a failing one does not stop the others. Prints a summary at the end.
#  1. GPU tests of the engine side: test_plan, test_cuda_engine, test_copy_kernel, test_copy_blocks,
#     test_manager_engines (real engines, bytes compared with random data).
#  2. `kvmgr bench swap` step table (512 queued one-block stores of 48 x 4 KiB; cuda engine on
#     consecutive ids: target 150 us; kernel engine on scattered ids: target 300 us), this tree
#     and the tree before this helper's work (commit f5ab5bc) alternately, twice if time allows,
#     when the checkout has git history; plus the copy columns of this tree (kernel, auto: bytes checked).
#  3. scripts/step_engine_ab.py on the H200 host's CPU (fake CUDA: the plan and engine share of
#     a step without driver calls), both trees alternately.
set -uo pipefail
OUT=${OUT:-out}
D="$OUT/stepplan"
mkdir -p "$D"
export PYTHONUNBUFFERED=1
NEW="$PWD"
BASE=f5ab5bc
STEP_ARGS=(--geometries qwen --blocks 64 --variants none --repeats 10 --warmup 3
  --step-swaps 512 --step-engines cuda kernel)

PYTHONPATH="$NEW${PYTHONPATH:+:$PYTHONPATH}" timeout 50 python3 -m pytest -q -p no:randomly tests/transfer/test_plan.py \
  tests/transfer/test_cuda_engine.py tests/kernels/test_copy_kernel.py tests/kernels/test_copy_blocks.py \
  tests/manager/test_manager_engines.py > "$D/pytest.txt" 2>&1 || echo "section 1: pytest rc=$? (pytest.txt)"

OLD=""
if git rev-parse --verify -q "$BASE" >/dev/null 2>&1; then
  OLD="$(mktemp -d)"
  git archive "$BASE" kvmgr scripts | tar -x -C "$OLD"
fi
for run in 1 2; do
  [ "$run" = 2 ] && [ "$SECONDS" -gt 60 ] && { echo "section 2: second round skipped (time)"; break; }
  for tree in old new; do
    root="$NEW"; [ "$tree" = old ] && root="$OLD"
    [ -z "$root" ] && continue
    PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" timeout 25 python3 -m kvmgr.cli bench swap "${STEP_ARGS[@]}" \
      --json "$D/step_${tree}_${run}.json" > "$D/step_${tree}_${run}.txt" 2>&1 \
      || echo "section 2: step table ($tree, run $run) rc=$?"
  done
done
[ -z "$OLD" ] && echo "section 2: no git history: the old tree's step table is skipped"
PYTHONPATH="$NEW${PYTHONPATH:+:$PYTHONPATH}" timeout 20 python3 -m kvmgr.cli bench swap --geometries qwen --blocks 512 \
  --variants kernel auto --repeats 5 --warmup 2 --step-swaps 0 --json "$D/copies.json" \
  > "$D/copies.txt" 2>&1 || echo "section 2: copy columns rc=$? (copies.txt)"

for tree in old new; do
  root="$NEW"; [ "$tree" = old ] && root="$OLD"
  [ -z "$root" ] && continue
  (cd /tmp && PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" timeout 10 python3 "$NEW/scripts/step_engine_ab.py" \
    --repeats 20) >> "$D/cpu_ab_$tree.txt" 2>&1 || echo "section 3: cpu a/b ($tree) rc=$?"
done

echo "=== stepplan summary"
tail -n 3 "$D/pytest.txt"
python3 scripts/gpu/step_summary.py "$D"
python3 - "$D" <<'EOF'
import json, os, sys
d = sys.argv[1]
try:
    copies = json.load(open(os.path.join(d, "copies.json")))["copies"]
    print("copy columns ok:", all(r["ok"] for r in copies),
          [(r["variant"], r["direction"], round(r["us"])) for r in copies][:8])
except (OSError, KeyError, ValueError) as exc:
    print("copy columns: none", exc)
EOF
for tree in old new; do [ -f "$D/cpu_ab_$tree.txt" ] && { echo "cpu a/b $tree:"; cat "$D/cpu_ab_$tree.txt"; }; done
