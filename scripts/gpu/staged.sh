#!/usr/bin/env bash
# Issue 24, section 2 on the H200: the staged path's GPU tests, then `bench duplex` with the CPU
# ids scattered (as in earlier rounds) and in runs (what the CPU tier's allocator hands out for
# a store of fresh or evicted-together blocks), then the calibration fitted from the rows.
# Run from the repository root; writes under $OUT/staged/. Each section has its own timeout
# and a failing one does not stop the others (<= ~230 s in all).
source "${BASH_SOURCE%/*}/_common.sh" staged

# 1. GPU tests: staged bytes (both directions, chunked), auto staging a step; CPU tests too
timeout 45 python3 -m pytest -q -rfE -p no:randomly tests/transfer/test_staged_gpu.py tests/transfer/test_staged.py \
  tests/transfer/test_duplex.py >"$D/pytest.log" 2>&1
section pytest $?
tail -5 "$D/pytest.log"

# 2. both directions at once, 512 blocks each way; CPU ids scattered, in runs of 32, all in runs
#    of 512 (one run per direction)
for runs in 1 32 512; do
  timeout 60 python3 -m kvmgr.cli bench duplex --repeats 5 --host-runs "$runs" \
    --json "$D/duplex_runs$runs.json" >"$D/duplex_runs$runs.log" 2>&1
  section "duplex_runs$runs" $?
done

# 3. the table: ratio (limit time / variant time; goal >= 0.8) per variant and CPU-run length
python3 - "$D" <<'PY' 2>&1 | tee "$D/summary.txt"
import json, sys
d = sys.argv[1]
show = ["dma+dma", "kernel+kernel", "dma+kernel", "kernel+contiguous", "contiguous+kernel",
        "staged+staged", "staged+kernel", "kernel+staged", "staged+dma", "dma+staged",
        "auto", "engine auto", "engine cuda"]
for runs in (1, 32, 512):
    try:
        rows = [json.loads(l) for l in open(f"{d}/duplex_runs{runs}.log") if l.startswith("{")]
    except OSError as exc:
        print(f"runs {runs}: {exc}")
        continue
    for geometry in dict.fromkeys(r.get("geometry") for r in rows):
        got = {r["variant"]: r for r in rows if r.get("geometry") == geometry}
        limit = got.get("limit", {})
        print(f"== {geometry}, CPU runs of {runs}: limit {limit.get('us')} us "
              f"({limit.get('gbps')} GB/s)")
        for name in show:
            r = got.get(name)
            if r is None:
                continue
            if "error" in r:
                print(f"  {name:18s} ERROR {r['error'][:150]}")
                continue
            extra = f"  {r.get('choice', '')} model {r.get('model_us', '')}" if name == "auto" else ""
            print(f"  {name:18s} ratio {r.get('ratio')}  {r['us']} us  host {r['host_us']} us"
                  f"  overlap {r.get('overlap')}{extra}")
        for name in ("gather d2h", "scatter h2d", "staged d2h", "staged h2d", "dma d2h",
                     "dma h2d", "kernel d2h", "kernel h2d"):
            r = got.get(name)
            if r is not None and "gbps" in r:
                print(f"  alone {name:12s} {r['us']} us  {r['gbps']} GB/s  host {r['host_us']} us")
        for name, r in got.items():
            if "error" in r and name not in show:
                print(f"  {name:18s} ERROR {r['error'][:150]}")
PY

# 4. the constants refitted: the duplex ones from the runs-of-32 rows (limit, kernel+kernel,
#    mixed, gather), the paged kernel's from layerwise.sh's swap-kernel run if it is there
SK="$OUT/layerwise/swap_kernel.json"
timeout 20 python3 scripts/fit_calibration.py --duplex "$D/duplex_runs32.json" \
  $( [ -f "$SK" ] && echo --swap-kernel "$SK" ) --out "$D/calibration.json" \
  2>&1 | tee "$D/calibration.txt"
exit 0
