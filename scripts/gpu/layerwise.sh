#!/usr/bin/env bash
# Issue 24 on the H200: layerwise GPU tests, the duplex bench, the paged kernel's refit, the
# end-to-end engine run. Run from the repository root; writes JSON and logs under
# $OUT/layerwise/. Each section has its own timeout and a failing section does not stop the
# others (budget: <= ~5 minutes of device time in all).
set -u
OUT=${OUT:-/tmp/out}
DIR="$OUT/layerwise"
mkdir -p "$DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
section() { echo "{\"section\": \"$1\", \"rc\": $2}" | tee -a "$DIR/sections.jsonl"; }

# 1. GPU tests of the new code (layerwise on the CUDA engines, the example engine with layerwise)
timeout 80 python3 -m pytest -q -rfE -p no:randomly tests/test_layerwise_gpu.py \
  tests/test_layerwise.py tests/test_duplex.py \
  "tests/test_example_engine.py::test_engine_on_cuda_equals_its_run_without_offload" \
  >"$DIR/pytest.log" 2>&1
section pytest $?
tail -5 "$DIR/pytest.log"

# 2. both directions at once: every path pair and auto against two contiguous copies
timeout 60 python3 -m kvmgr.cli bench duplex --repeats 5 --json "$DIR/duplex.json" \
  >"$DIR/duplex.log" 2>&1
section duplex $?
cat "$DIR/duplex.log"

# 3. the paged kernel's constants, refitted (prints the fitted Calibration as JSON)
timeout 45 python3 -m kvmgr.cli bench swap-kernel --json "$DIR/swap_kernel.json" \
  >"$DIR/swap_kernel.log" 2>&1
section swap_kernel $?
timeout 20 python3 - "$DIR" <<'PY' 2>&1 | tee "$DIR/calibration.json"
import attrs, json, sys
from kvmgr.transfer.cost_model import Calibration
d = sys.argv[1]
out = {}
for name in ("swap_kernel", "duplex"):
    try:
        out[name] = attrs.asdict(Calibration.from_json(f"{d}/{name}.json"))
    except Exception as exc:
        out[name] = repr(exc)
print(json.dumps(out))
PY

# 4. end to end: recompute vs whole-prefix load vs layerwise load (Mooncake slice)
timeout 130 python3 -m examples.engine.bench --rounds 1 --requests 120 \
  --variants recompute,auto,auto-layerwise --json "$DIR/engine.json" >"$DIR/engine.log" 2>&1
section engine $?
tail -25 "$DIR/engine.log"
python3 - "$DIR" <<'PY' 2>&1 | tee "$DIR/engine_summary.json"
import json, sys
try:
    results = {r["variant"]: r for r in json.load(open(f"{sys.argv[1]}/engine.json"))["results"]}
    base = results["recompute"]
    summary = {
        name: {
            "throughput_x_recompute": r["requests_per_s"] / base["requests_per_s"],
            "ttft_p99_x_recompute": r["ttft_p99_s"] / base["ttft_p99_s"],
            "host_share": r["offload_host_share"],
            "layerwise_step_over_load": r.get("layerwise_step_over_load"),
        }
        for name, r in results.items()
    }
    print(json.dumps(summary))
except Exception as exc:
    print(json.dumps({"error": repr(exc)}))
PY
exit 0
