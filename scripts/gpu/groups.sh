#!/usr/bin/env bash
# Cache groups on the GPU (issue 28 section 1): a GroupedManager over CUDA tensors per group
# (full attention, sliding window, recurrent state) with the default engine: store, evict the
# GPU copies (poison), look up, load the plan (window only / one state), compare every byte.
# Also runs the CPU tests of kvmgr/groups once on the GPU machine. Under a minute.
# Writes $OUT/groups/round_trip.json and $OUT/groups/pytest.txt.
set -euo pipefail
mkdir -p "$OUT/groups"
python3 -m pytest -q -p no:randomly tests/groups/test_groups_spec.py tests/groups/test_groups_index.py \
  tests/groups/test_groups_manager.py tests/groups/test_groups_workload.py tests/examples/test_example_hybrid.py \
  > "$OUT/groups/pytest.txt" 2>&1 || echo "pytest failed (see pytest.txt)"
python3 - "$OUT/groups/round_trip.json" <<'PY'
import asyncio, hashlib, json, sys, time
import torch
from kvmgr import ManagerConfig
from kvmgr.groups import GroupedLayout, GroupedManager, GroupSpec

BS, N_GPU, N_BLOCKS = 16, 512, 64   # 64 blocks = 1024 tokens
page = BS * 8 * 64 * 2               # 8 KV heads x 64 dims, bf16, per K or V
layout = GroupedLayout([
    GroupSpec(name="full", kind="full", block_size=BS, page_bytes=(page,) * 8),
    GroupSpec(name="swa", kind="sliding_window", block_size=BS, page_bytes=(page,) * 8, window=128),
    GroupSpec(name="mamba", kind="recurrent", block_size=BS, page_bytes=(1 << 20,) * 2),
], hash_block_size=BS)
dev = torch.device("cuda")
gpu = {g.name: [torch.randint(0, 256, (N_GPU, p), dtype=torch.uint8, device=dev) for p in g.page_bytes]
       for g in layout.groups}
hashes, parent = [], b""
for i in range(N_BLOCKS):
    parent = hashlib.blake2b(parent + bytes([i % 256, i // 256])).digest()
    hashes.append(parent)

async def main():
    cfg = ManagerConfig(num_cpu_blocks=1, manage_gpu_blocks=False, pin_host="sync")
    async with GroupedManager.create(layout, gpu, {"full": 128, "swa": 128, "mamba": 80}, cfg) as mgr:
        src = {g.name: list(range(N_BLOCKS)) for g in layout.groups}
        t0 = time.perf_counter(); f = mgr.store(hashes, src); await mgr.step(); res = await f
        store_s = time.perf_counter() - t0
        want = {n: [t[:N_BLOCKS].clone() for t in ts] for n, ts in gpu.items()}
        for ts in gpu.values():
            for t in ts: t.random_(0, 256)
        plan = mgr.lookup(hashes)
        dst = {g.name: [256 + j for j in range(N_BLOCKS)] for g in layout.groups}
        t0 = time.perf_counter(); f = mgr.load(plan, dst); await mgr.step(); await f
        torch.cuda.synchronize(); load_s = time.perf_counter() - t0
        ok = all(torch.equal(t[256 + j], w[j]) for g, b in zip(layout.groups, plan.blocks)
                 for t, w in zip(gpu[g.name], want[g.name]) for j in b)
        return {"ok": ok, "num_tokens": plan.num_tokens, "blocks": [len(b) for b in plan.blocks],
                "bytes_loaded": plan.num_bytes, "bytes_stored": res.num_bytes,
                "store_s": store_s, "load_s": load_s, "engine": mgr.managers[0].statistics().engine}

out = asyncio.run(main())
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(out)
sys.exit(0 if out["ok"] else 1)
PY
