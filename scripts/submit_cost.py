"""Host cost of ``OffloadManager.step()`` and of engine submission, on CPU, for issue 12.

    python3 scripts/submit_cost.py [--swaps 512] [--repeats 30]

Runs the CUDA engines without a GPU: ``torch.cuda`` streams and events are stand-ins that do
nothing, the driver's ``cuMemcpyBatchAsync`` / ``cuMemcpyAsync`` resolve to libc's ``sched_yield``
(a C call that returns 0 and ignores its arguments) and the copy kernel's launch is a no-op. So it
measures every host cost of a submission except the real driver calls and the real launch:
planning, the manager's bookkeeping, fences, events, descriptor handling, the cost model, table
staging. Prints medians (and minimum) of ``StepReport.host_s`` and of the engine's ``submit_s``
for ``--swaps`` queued one-block stores of 48 x 4 KiB pages, consecutive and scattered ids.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _fake_cuda  # scripts/: this script's folder
import numpy as np
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.transfer.driver import CopyDriver


def _stub_driver() -> CopyDriver:
    noop = ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value
    return CopyDriver(lambda symbol, version: noop, driver_version=13000)


async def _case(engine_name: str, scattered: bool, swaps: int, repeats: int) -> dict[str, float]:
    from kvmgr.transfer.cuda_engine import AutoEngine, CopyKernelEngine, CudaBatchEngine

    cls = {"cuda": CudaBatchEngine, "kernel": CopyKernelEngine, "auto": AutoEngine}[engine_name]
    options: dict[str, Any] = {"driver": _stub_driver(), "device": "cuda:0"}
    if engine_name != "cuda":
        options["warmup"] = False
    engine = cls(**options)
    kv = [torch.empty((2 * swaps + 1, 4096), dtype=torch.uint8) for _ in range(48)]
    config = ManagerConfig(num_cpu_blocks=4 * swaps, manage_gpu_blocks=False)
    ids = 2 * np.random.default_rng(0).permutation(swaps) if scattered else np.arange(swaps)
    host, submit = [], []
    async with OffloadManager(kv, config, engine=engine) as mgr:
        for r in range(repeats + 3):
            futures = [
                mgr.swap_out([int(g)], keys=[f"{r}:{i}".encode()]) for i, g in enumerate(ids)
            ]
            before = engine.statistics().submit_s
            report = await mgr.step()
            after = engine.statistics().submit_s
            await asyncio.gather(*futures)
            if r >= 3:
                host.append(report.host_s * 1e6)
                submit.append((after - before) * 1e6)
    return {"host": statistics.median(host), "host_min": min(host),
            "submit": statistics.median(submit), "submit_min": min(submit)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--swaps", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    _fake_cuda.install()
    for engine, scattered in (("cuda", False), ("kernel", True), ("auto", False), ("auto", True)):
        t0 = time.perf_counter()
        row = asyncio.run(_case(engine, scattered, args.swaps, args.repeats))
        ids = "scattered" if scattered else "consecutive"
        print(f"{engine:6s} {ids:11s} step host us median {row['host']:6.0f} (min "
              f"{row['host_min']:5.0f}); engine submit us median {row['submit']:5.0f} (min "
              f"{row['submit_min']:4.0f})  [{time.perf_counter() - t0:.1f} s]")  # fmt: skip


if __name__ == "__main__":
    main()
