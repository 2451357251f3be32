#!/usr/bin/env bash
# Session 3's last H200 call (issues 24, 27): the GPU tests that failed in the suite run (a
# test that freed a registered pinned buffer), then the staged duplex table, the step table and
# the host path. Writes under $OUT; every section has its own limit.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 70 python3 -m pytest -q -rfE -p no:cacheprovider -p no:benchmark -n 4 \
  tests/transfer/test_staged_gpu.py tests/examples/test_example_engine.py tests/transfer/test_staged.py 2>&1 | tail -6
OUT="$OUT" timeout 230 bash scripts/gpu/staged.sh > "$OUT/staged.txt" 2>&1; echo "staged rc=$?"
grep -E "^== |staged\+staged|auto |engine auto|kernel\+kernel|dma\+kernel|staged\+kernel|kernel\+staged" "$OUT/staged/summary.txt" 2>/dev/null
OUT="$OUT" timeout 150 bash scripts/gpu/stepplan.sh > "$OUT/stepplan.txt" 2>&1; echo "stepplan rc=$?"
sed -n '/=== stepplan summary/,$p' "$OUT/stepplan.txt" | head -40
timeout 90 python3 -m kvmgr.cli bench host --rounds 200 --steps 1000 --json "$OUT/bench_host.json" > "$OUT/bench_host.txt" 2>&1; echo "bench host rc=$?"
tail -30 "$OUT/bench_host.txt"
