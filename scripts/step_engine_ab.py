"""Engine-side host cost of ``OffloadManager.step()`` on CPU (issue 27, helper ``stepplan``).

    PYTHONPATH=<tree> python3 scripts/step_engine_ab.py [--repeats 40] [--json out.json]

Runs the CUDA engines without a GPU, like ``scripts/submit_cost.py``: ``torch.cuda`` streams and
events are stand-ins that do nothing, ``cuMemcpyBatchAsync`` / ``cuMemcpyAsync`` resolve to
libm's ``fegetround`` (a C call that returns 0), host registration is a no-op and the copy
kernel's table slots are plain CPU tensors; the paged kernel's launch is stubbed at
``launch_block_table``. Everything else is the real code: ``build_plan``, the descriptors, the
DMA issuer's driver call through ctypes, the kernel's run table staging and upload call, the
streams' bookkeeping.

Per case (512 queued one-block stores of 48 x 4 KiB pages; ``cuda`` on consecutive GPU ids,
``kernel`` on scattered ones, as in ``kvmgr bench swap``'s step table), medians over
``--repeats`` steps of:

- ``host``: ``StepReport.host_s``;
- ``plan``: the worker's ``build_plan`` inside the step (counted as "manager" by ``bench swap``);
- ``engine``: the engine's ``submit`` (``statistics().submit_s``); ``issue``: its ``issue_s``;
- ``below``: plan + engine, the part below the scheduler this helper owns.

The minimum of each is printed too (on a shared machine the minimum moves least with the load).

The store calls before each step leave the caches as a serving loop does, so these figures are
several times those of a tight loop over ``submit`` alone. Run it on two trees alternately to
compare (``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import json
import statistics
import time
from pathlib import Path
from typing import Any

import _fake_cuda  # scripts/: this script's folder
import numpy as np
import torch


def stub_driver() -> Any:
    """A ``CopyDriver`` whose entry points are libm's ``fegetround`` (no arguments read, no
    system call, returns 0 = ``FE_TONEAREST`` on x86-64), else libc's ``sched_yield`` (a system
    call that gives the CPU away on a loaded machine: its figures then include other processes)."""
    from kvmgr.transfer.driver import CopyDriver

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6").fegetround
        if fn() != 0:
            raise OSError("fegetround is not 0")
    except (OSError, AttributeError):
        fn = ctypes.CDLL(None).sched_yield
    noop = ctypes.cast(fn, ctypes.c_void_p).value
    return CopyDriver(lambda symbol, version: noop, driver_version=13000)


async def _case(engine_name: str, scattered: bool, swaps: int, repeats: int) -> dict[str, float]:
    from kvmgr import ManagerConfig, OffloadManager
    from kvmgr.transfer.cuda_engine import CopyKernelEngine, CudaBatchEngine

    cls = {"cuda": CudaBatchEngine, "kernel": CopyKernelEngine}[engine_name]
    options: dict[str, Any] = {"driver": stub_driver(), "device": "cuda:0"}
    if engine_name == "kernel":
        options["warmup"] = False
    engine = cls(**options)
    kv = [torch.empty((2 * swaps + 1, 4096), dtype=torch.uint8) for _ in range(48)]
    config = ManagerConfig(num_cpu_blocks=4 * swaps, manage_gpu_blocks=False)
    ids = 2 * np.random.default_rng(0).permutation(swaps) if scattered else np.arange(swaps)
    samples: dict[str, list[float]] = {}
    async with OffloadManager(kv, config, engine=engine) as mgr:
        worker = _worker(mgr)
        plan_s: list[float] = []
        build = worker._plan

        def timed_plan(job: Any) -> Any:
            t0 = time.perf_counter()
            plan = build(job)
            plan_s.append(time.perf_counter() - t0)
            return plan

        worker._plan = timed_plan
        for r in range(repeats + 3):
            futures = [
                mgr.swap_out([int(g)], keys=[f"{r}:{i}".encode()]) for i, g in enumerate(ids)
            ]
            plan_s.clear()
            before = engine.statistics()
            report = await mgr.step()
            after = engine.statistics()
            await asyncio.gather(*futures)
            if r < 3:
                continue
            engine_s = after.submit_s - before.submit_s
            row = {"host": report.host_s, "plan": sum(plan_s), "engine": engine_s,
                   "issue": after.issue_s - before.issue_s, "below": sum(plan_s) + engine_s}  # fmt: skip
            for key, value in row.items():
                samples.setdefault(key, []).append(value * 1e6)
    out = {key: statistics.median(values) for key, values in samples.items()}
    return out | {f"{key}_min": min(values) for key, values in samples.items() if key != "issue"}


def _worker(mgr: Any) -> Any:
    """The in-process ``TransferWorker`` behind a manager."""
    for path in ("_worker", "worker"):
        worker = getattr(mgr, path, None)
        if worker is not None and hasattr(worker, "_plan"):
            return worker
    transport = mgr._flusher.transport  # type: ignore[attr-defined]
    return transport.worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--swaps", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    _fake_cuda.install()
    rows = []
    for engine, scattered in (("cuda", False), ("kernel", True)):
        row = asyncio.run(_case(engine, scattered, args.swaps, args.repeats))
        ids = "scattered" if scattered else "consecutive"
        rows.append({"engine": engine, "ids": ids, **row})
        print(
            f"{engine:6s} {ids:11s} "
            + "  ".join(f"{k} {v:5.0f}" for k, v in row.items() if not k.endswith("_min"))
        )
        print(
            f"{'':18s} min: "
            + "  ".join(f"{k[:-4]} {v:5.0f}" for k, v in row.items() if k.endswith("_min"))
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
