"""Per-piece host time of one engine submit on the GPU machine (ad hoc, no profiler).

Times ``CudaBatchEngine.submit`` / ``CopyKernelEngine.submit`` of a 512-block consecutive and a
scattered store plan (48 x 4 KiB pages) with ``perf_counter`` wrappers around each piece, for
the raw-event path and torch's event path in one process. Prints medians in us.
"""

from __future__ import annotations

import collections
import statistics
import time

import numpy as np
import torch

from kvmgr.pool.layout import KVLayout
from kvmgr.transfer import cuda_base, streams
from kvmgr.transfer.cuda_engine import CopyKernelEngine, CudaBatchEngine
from kvmgr.transfer.plan import Direction, build_plan

ACC: dict[str, list[float]] = collections.defaultdict(list)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        ACC[name].append((time.perf_counter() - t) * 1e6)
        return out

    return wrapper


def main() -> None:
    blocks, tensors, page = 512, 48, 4096
    gpu = [
        torch.randint(0, 256, (2 * blocks + 1, page), dtype=torch.uint8, device="cuda")
        for _ in range(tensors)
    ]
    cuda_base.check_plan = timed("check_plan", cuda_base.check_plan)
    streams.CopyStreams._queue = timed("_queue", streams.CopyStreams._queue)
    rng = np.random.default_rng(0)
    for cls in (CudaBatchEngine, CopyKernelEngine):
        engine = cls(device=torch.device("cuda", 0))
        host = engine.allocate_host(tensors * blocks * page).view(tensors, blocks, page)
        gl, hl = KVLayout.from_tensors(gpu), KVLayout.from_tensors(list(host.unbind(0)))
        engine._issuer.issue = timed("issue", engine._issuer.issue)
        for mode in ("pooled", "fresh"):
            engine._streams._pooled = mode == "pooled"
            for ids in ("consecutive", "scattered"):
                if cls is CudaBatchEngine and ids == "scattered":
                    continue
                src = np.arange(blocks) if ids == "consecutive" else 2 * rng.permutation(blocks)
                ACC.clear()
                for rep in range(40):
                    plan = build_plan(Direction.D2H, gl, hl, src, np.arange(blocks))
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    handle = engine.submit(plan)
                    ACC["submit total"].append((time.perf_counter() - t) * 1e6)
                    handle.future.result(timeout=30)
                    if rep < 5:
                        for v in ACC.values():
                            v.clear()
                parts = ", ".join(
                    f"{k} {statistics.median(v):.1f}x{len(v) // 35}" for k, v in ACC.items() if v
                )
                print(f"{cls.__name__} {mode} {ids}: {parts}", flush=True)
        engine._streams._pooled = True
        engine.close()


if __name__ == "__main__":
    main()
