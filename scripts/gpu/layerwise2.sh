#!/usr/bin/env bash
# Issue 24, sections 1 and 3 on the H200 (helper lwhost): the layerwise GPU tests serial and
# under -n 4 (the group end-time order failed there), a diagnostic of each group's end event
# (recorded on which stream, recycled or not, elapsed time) and of the host cost per group, and
# the short end-to-end bench. Run from the repository root; writes under $OUT/layerwise2/.
# Each section has its own timeout; a failing section does not stop the others (<= ~200 s).
source "${BASH_SOURCE%/*}/_common.sh" layerwise2

# 1. the layerwise tests, serial, then the GPU file under 4 workers (pytest-benchmark refuses
#    xdist: -p no:benchmark)
timeout 40 python3 -m pytest -q -rfE -p no:randomly tests/transfer/test_layerwise_gpu.py \
  tests/transfer/test_layerwise.py tests/transfer/test_layerwise_fake_cuda.py >"$D/pytest_serial.log" 2>&1
section pytest_serial $?
tail -4 "$D/pytest_serial.log"
timeout 30 python3 -m pytest -q -rfE -p no:randomly -p no:benchmark -n 4 \
  tests/transfer/test_layerwise_gpu.py >"$D/pytest_n4.log" 2>&1
section pytest_n4 $?
tail -4 "$D/pytest_n4.log"

# 2. diagnostic: per group, its end event (id), the streams it was recorded on during the load
#    (the load stream only, expected), how often (2+: recycled from an earlier group that had
#    ended: pooled events), elapsed ms from group 0's end event; pooled and fresh events; then
#    host us of load_layerwise (8 groups) + 32 wait_layer against load_many + step
timeout 35 python3 - <<'PY' 2>&1 | tee "$D/diag.log"
import asyncio, hashlib, json, statistics, time
import torch
from kvmgr import ManagerConfig, OffloadManager
from kvmgr.transfer import streams
from kvmgr.transfer.plan import Direction

LOG = []
class LoggingEvent(torch.cuda.Event):  # still torch's own event class: pooled as in serving
    def record(self, stream=None):
        LOG.append((id(self), None if stream is None else stream.cuda_stream))
        return super().record(stream)
torch.cuda.Event = LoggingEvent
real = streams._real_cuda_events

async def order(engine, pooled):
    streams._real_cuda_events = real if pooled else (lambda: False)
    caches = [torch.randint(0, 256, (256, 32768), dtype=torch.uint8, device="cuda") for _ in range(16)]
    keys = [hashlib.blake2b(bytes([i])).digest() for i in range(64)]
    async with OffloadManager(caches, ManagerConfig(num_cpu_blocks=128, engine=engine)) as mgr:
        src = mgr.allocate("a", 64); f = mgr.store_many(src, keys); await mgr.step(); await f
        dst = mgr.allocate("b", 64)
        h2d = mgr.engine.stream(Direction.H2D).cuda_stream
        LOG.clear()
        load = mgr.load_layerwise(keys, dst, layers=2)
        for layer in range(8):
            load.wait_layer(layer)
        torch.cuda.synchronize(); await load
        ends = [h.end_event for h in load.batches.handles]
        rows = []
        for g, e in enumerate(ends):
            recs = [s for i, s in LOG if i == id(e)]
            rows.append({"group": g, "event": hex(id(e))[-6:], "streams": sorted(set(recs)),
                         "records": len(recs), "elapsed_ms": round(ends[0].elapsed_time(e), 4)})
        gaps = [r["elapsed_ms"] for r in rows]
        print(json.dumps({"engine": engine, "events": "pooled" if pooled else "fresh",
                          "load_stream": h2d, "distinct_end_events": len(set(map(id, ends))),
                          "in_order": all(b >= a for a, b in zip(gaps, gaps[1:])), "groups": rows}))
    streams._real_cuda_events = real

async def host(engine):
    caches = [torch.zeros(512, 32768, dtype=torch.uint8, device="cuda") for _ in range(64)]
    keys = [hashlib.blake2b(bytes([i, 7])).digest() for i in range(96)]
    async with OffloadManager(caches, ManagerConfig(num_cpu_blocks=128, engine=engine)) as mgr:
        src = mgr.allocate("a", 96); f = mgr.store_many(src, keys); await mgr.step(); await f
        dst = mgr.allocate("b", 96)
        lw, waits, whole = [], [], []
        for i in range(25):
            torch.cuda.synchronize()
            t0 = time.perf_counter(); load = mgr.load_layerwise(keys, dst, layers=2, max_groups=8)
            t1 = time.perf_counter()
            for layer in range(32):
                load.wait_layer(layer)
            t2 = time.perf_counter(); torch.cuda.synchronize(); await load
            t3 = time.perf_counter(); f = mgr.load_many(keys, dst); await mgr.step()
            t4 = time.perf_counter(); await f
            if i >= 5:
                lw.append(t1 - t0); waits.append(t2 - t1); whole.append(t4 - t3)
        med = lambda v: round(1e6 * statistics.median(v), 1)
        print(json.dumps({"engine": engine, "host_us_load_layerwise_8_groups": med(lw),
                          "host_us_32_wait_layer": med(waits),
                          "host_us_load_many_plus_step": med(whole),
                          "host_us_per_group_over_whole": round((med(lw) + med(waits) - med(whole)) / 8, 1)}))

for engine in ("cuda", "kernel", "auto"):
    for pooled in (True, False):
        asyncio.run(order(engine, pooled))
for engine in ("cuda", "kernel", "auto"):
    asyncio.run(host(engine))
PY
section diag ${PIPESTATUS[0]}

# 3. end to end: recompute vs whole-prefix load vs layerwise load+store (Mooncake slice); the
#    hit probe also with the DMA engine (does the copy kernel slow the forward it runs under?)
timeout 95 python3 -m examples.engine.bench --rounds 1 --requests 120 \
  --variants recompute,auto,auto-layerwise --probe-engines cuda --json "$D/engine.json" \
  >"$D/engine.log" 2>&1
section engine $?
tail -24 "$D/engine.log"
python3 - "$D" <<'PY' 2>&1 | tee "$D/engine_summary.json"
import json, sys
try:
    data = json.load(open(f"{sys.argv[1]}/engine.json"))
    results = {r["variant"]: r for r in data["results"]}
    base = results["recompute"]
    out = {v: {"throughput_x_recompute": round(r["requests_per_s"] / base["requests_per_s"], 3),
               "ttft_p99_x_recompute": round(r["ttft_p99_s"] / base["ttft_p99_s"], 3),
               "host_us_per_step": round(r.get("offload_host_us_per_step") or 0, 1),
               "host_share": r["offload_host_share"], "layerwise_stores": r.get("layerwise_stores"),
               "layerwise_steps": r.get("layerwise_steps"), "layerwise_failed": r.get("layerwise_failed")}
           for v, r in results.items()}
    for k, v in data["meta"].items():
        if k.startswith("hit_probe") and v:
            out[k] = {"ratio_goal_le_1.1": round(v["ratio"], 3), "load_ms": round(1e3 * v["load_s"], 2),
                      "compute_ms": round(1e3 * v["compute_s"], 2),
                      "layerwise_ms": round(1e3 * v["layerwise_s"], 2), "groups": v["max_groups"],
                      "engine": v["engine"]}
    print(json.dumps(out, indent=1))
except Exception as exc:
    print(json.dumps({"error": repr(exc)}))
PY
exit 0
