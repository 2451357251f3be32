#!/usr/bin/env bash
# Issue 24 on the H200: layerwise GPU tests, the duplex bench, the paged kernel's refit, the
# end-to-end engine run. Run from the repository root; writes JSON and logs under
# $OUT/layerwise/. Each section has its own timeout and a failing section does not stop the
# others (budget: <= ~5 minutes of device time in all).
source "${BASH_SOURCE%/*}/_common.sh" layerwise

# 1. GPU tests of the new code (layerwise on the CUDA engines, the example engine with layerwise)
timeout 60 python3 -m pytest -q -rfE -p no:randomly tests/transfer/test_layerwise_gpu.py \
  tests/transfer/test_layerwise.py tests/transfer/test_layerwise_fake_cuda.py tests/transfer/test_duplex.py \
  "tests/examples/test_example_engine.py::test_engine_on_cuda_equals_its_run_without_offload" \
  "tests/examples/test_example_engine.py::test_decode_graphs_match_the_eager_decode" \
  "tests/examples/test_example_engine.py::test_engine_decodes_in_cuda_graphs_on_the_gpu" \
  >"$D/pytest.log" 2>&1
section pytest $?
tail -5 "$D/pytest.log"

# 2. both directions at once: every path pair and auto against two contiguous copies
timeout 70 python3 -m kvmgr.cli bench duplex --repeats 5 --json "$D/duplex.json" \
  >"$D/duplex.log" 2>&1
section duplex $?
cat "$D/duplex.log"

# 3. the paged kernel's constants, refitted (prints the fitted Calibration as JSON)
timeout 25 python3 -m kvmgr.cli bench swap-kernel --geometries qwen llama --blocks 64 512 \
  --programs --repeats 5 --matmuls 10 --interference-repeats 3 --json "$D/swap_kernel.json" \
  >"$D/swap_kernel.log" 2>&1
section swap_kernel $?
timeout 20 python3 - "$D" <<'PY' 2>&1 | tee "$D/calibration.json"
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

# 4. end to end: recompute vs whole-prefix load vs layerwise load, decode steps in CUDA graphs;
#    the Mooncake slice, then a high-reuse multi-turn slice
timeout 90 python3 -m examples.engine.bench --rounds 1 --requests 120 \
  --variants recompute,auto,auto-layerwise --json "$D/engine.json" >"$D/engine.log" 2>&1
section engine_mooncake $?
tail -22 "$D/engine.log"
timeout 55 python3 -m examples.engine.bench --rounds 1 --slice multiturn --requests 64 \
  --turns 4 --turn-gap 0.5 --variants recompute,auto,auto-layerwise \
  --json "$D/engine_multiturn.json" >"$D/engine_multiturn.log" 2>&1
section engine_multiturn $?
tail -22 "$D/engine_multiturn.log"
python3 - "$D" <<'PY' 2>&1 | tee "$D/engine_summary.json"
import json, sys
summary = {}
for name in ("engine", "engine_multiturn"):
    try:
        data = json.load(open(f"{sys.argv[1]}/{name}.json"))
        rows = data["results"]
        results = {r["variant"]: r for r in rows}
        base = results["recompute"]
        summary[name] = {
            variant: {
                "throughput_x_recompute": r["requests_per_s"] / base["requests_per_s"],
                "ttft_p50_x_recompute": r["ttft_p50_s"] / base["ttft_p50_s"],
                "ttft_p99_x_recompute": r["ttft_p99_s"] / base["ttft_p99_s"],
                "host_share": r["offload_host_share"],
                "host_us_per_step": r.get("offload_host_us_per_step"),
                "forward_share": r.get("forward_share"),
                "graph_steps": r.get("graph_steps"),
                "layerwise_step_over_load": r.get("layerwise_step_over_load"),
            }
            for variant, r in results.items()
        }
        summary[name]["hit_probe"] = data["meta"].get("hit_probe")
        summary[name]["hit_probe_per_layer"] = data["meta"].get("hit_probe_per_layer")
    except Exception as exc:
        summary[name] = {"error": repr(exc)}
print(json.dumps(summary))
PY
exit 0
