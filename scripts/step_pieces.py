"""Where one ``OffloadManager.step()`` spends its host time, piece by piece (issue 27).

    python3 scripts/step_pieces.py [--fake] [--repeats 200] [--swaps 512] [--json out.json]

Helpers ``stepcuda2``, ``stepcuda3``, ``stepflush``. The step of ``kvmgr bench swap``'s step table (512 queued one-block
stores of 48 x 4 KiB pages; the ``cuda`` engine on consecutive GPU ids, the ``kernel`` engine on
scattered ones), with the functions under the flush wrapped by a timer (``perf_counter_ns``):
per piece, calls and min / p10 / median us over ``--repeats`` steps, nested pieces included in
their callers. On a CUDA machine the real engines and driver run (the tensors on ``cuda:0``);
with ``--fake`` (or without a GPU) the fake CUDA of ``scripts/_fake_cuda.py`` and the stub
driver of ``scripts/step_cost_ab.py`` (kvmgr's Python share alone). Each wrapper adds its own
cost to its callers (printed as ``timer``: an empty wrapped call); the step's own figure is
``StepReport.host_s`` as the step reports it, with the timers in. Where the engine's streams
keep their event calls (``CopyStreams._record`` / ``_wait``), each record and wait is timed too
(with torch's events: the fence and end records and the fence's wait of every submit; a start
record only after ``wait_for`` waits).

Not a comparison: run ``scripts/step_cost_ab.py`` (one process, two trees) for ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

# (module, class or "" for a module function, attribute), outermost first
PIECES = [
    ("kvmgr.manager.flush", "Flusher", "flush"),
    ("kvmgr.scheduler.scheduler", "Scheduler", "take"),
    ("kvmgr.worker.tensors", "TensorGuard", "moved"),
    ("kvmgr.scheduler.scheduler", "Scheduler", "launch"),
    ("kvmgr.manager.flush", "Flusher", "_submit"),
    ("kvmgr.transport.local", "LocalTransport", "submit"),
    ("kvmgr.worker.worker", "TransferWorker", "submit"),
    ("kvmgr.worker.worker", "TransferWorker", "_plan"),
    ("kvmgr.worker.worker", "", "build_plan"),
    ("kvmgr.transfer.plan", "", "find_runs"),
    ("kvmgr.transfer.cuda_base", "CudaEngine", "submit"),
    ("kvmgr.transfer.streams", "CopyStreams", "submit"),
    ("kvmgr.transfer.dma", "DmaCopy", "issue"),
    ("kvmgr.transfer.plan", "BlockPairs", "descriptor_table"),  # (re-exported: old trees too)
    ("kvmgr.transfer.driver", "CopyDriver", "batch_at"),
    ("kvmgr.transfer.kernel", "KernelCopy", "issue"),
    ("kvmgr.kernels.copy.staging", "CopyStager", "copy_runs"),
    ("kvmgr.transfer.streams", "CopyStreams", "_queue"),
    ("kvmgr.transfer.streams", "", "on_device"),
    ("kvmgr.transfer.streams", "", "device_is_current"),
    ("kvmgr.transfer.cuda_current", "CurrentStream", "current"),
]


TIMES: dict[str, list[float]] = {}  # piece -> us per call, since the last clear


def _timed(key: str, fn: Any) -> Any:
    clock = time.perf_counter_ns

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES.setdefault(key, []).append((clock() - t0) / 1e3)

    return wrapper


def wrap_pieces() -> None:
    """Replace each piece (where this tree has it) by a timed wrapper, once per process."""
    for module, owner, name in PIECES:
        try:
            target: Any = importlib.import_module(module)
        except ImportError:  # a tree without it (an older or newer tree)
            continue
        if owner:
            target = getattr(target, owner, None)
        fn = getattr(target, name, None) if target is not None else None
        if fn is not None:
            setattr(target, name, _timed(f"{owner or module}.{name}", fn))


def make_manager(engine: str, swaps: int, fake: bool) -> Any:
    """The step table's manager (``manage_gpu_blocks=False``, 48 tensors of 4 KiB pages,
    ``4 * swaps`` CPU blocks)."""
    import kvmgr

    if fake:
        import step_cost_ab  # scripts/: the fake rig

        return step_cost_ab.Rig("kvmgr", engine, engine == "kernel", swaps).mgr
    tensors = [torch.randint(0, 256, (2 * swaps + 1, 4096), dtype=torch.uint8, device="cuda")
               for _ in range(48)]  # fmt: skip
    config = kvmgr.ManagerConfig(num_cpu_blocks=4 * swaps, engine=engine, manage_gpu_blocks=False)
    return kvmgr.OffloadManager(tensors, config)


def wrap_event_calls(mgr: Any) -> None:
    """Time the engine's event record and wait calls where its streams keep them
    (``CopyStreams._record`` / ``_wait``: helper stepcuda3's tree on)."""
    streams = getattr(mgr.engine, "_streams", None)
    for name in ("_record", "_wait"):
        if streams is not None and hasattr(streams, name):
            setattr(streams, name, _timed(f"CopyStreams.{name} (event)", getattr(streams, name)))
    if streams is not None and hasattr(streams, "_is_current"):  # hostpath15's device check
        streams._is_current = _timed("CopyStreams._is_current", streams._is_current)


async def run_case(engine: str, swaps: int, repeats: int, fake: bool) -> dict[str, Any]:
    mgr = make_manager(engine, swaps, fake)
    wrap_event_calls(mgr)
    rng = np.random.default_rng(0)
    ids = (2 * rng.permutation(swaps) if engine == "kernel" else np.arange(swaps)).tolist()
    host: list[float] = []
    async with mgr:
        for _ in range(2000):  # the CPU tier pinned in full before the first step (<= 20 s)
            if mgr.statistics().cpu_blocks_ready >= 4 * swaps:
                break
            await asyncio.sleep(0.01)
        for r in range(repeats + 5):
            if r == 5:  # after the warm-up steps
                TIMES.clear()
            futures = [mgr.swap_out([g], keys=[f"{r}:{i}".encode()]) for i, g in enumerate(ids)]
            mgr._settle_deferred()
            report = await mgr.step()
            await asyncio.gather(*futures)
            if r >= 5:
                host.append(report.host_s * 1e6)
    return {"engine": engine, "ids": "scattered" if engine == "kernel" else "consecutive",
            "host": _stats(host), "pieces": {k: _stats(v) for k, v in TIMES.items() if v}}  # fmt: skip


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"n": len(ordered), "min": ordered[0], "p10": ordered[len(ordered) // 10],
            "median": statistics.median(ordered)}  # fmt: skip


def timer_cost() -> float:
    """us one empty wrapped call adds (the timer's own share of every piece's caller)."""
    empty = _timed("empty", lambda: None)
    t0 = time.perf_counter_ns()
    for _ in range(10000):
        empty()
    TIMES.pop("empty", None)
    return (time.perf_counter_ns() - t0) / 1e3 / 10000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fake", action="store_true", help="fake CUDA and a stub driver")
    parser.add_argument("--engine", choices=["cuda", "kernel"], default=None)
    parser.add_argument("--swaps", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    fake = args.fake or not torch.cuda.is_available()
    sys.path.insert(0, str(ROOT))
    if fake:
        sys.path.insert(0, str(ROOT / "scripts"))
        import step_cost_ab

        step_cost_ab.install_fakes("kvmgr")
    wrap_pieces()
    engines = [args.engine] if args.engine else ["cuda", "kernel"]
    rows = [asyncio.run(run_case(e, args.swaps, args.repeats, fake)) for e in engines]
    where = "fake CUDA, stub driver" if fake else torch.cuda.get_device_name()
    print(f"step() pieces, {where}; {args.repeats} steps; us; timer {timer_cost():.2f} us a call")
    for row in rows:
        h = row["host"]
        print(f"{row['engine']} {row['ids']}: host_s min {h['min']:.0f} p10 {h['p10']:.0f} "
              f"median {h['median']:.0f}")  # fmt: skip
        for key, s in row["pieces"].items():
            print(f"  {key:30s} n {s['n']:5d}  min {s['min']:7.1f}  p10 {s['p10']:7.1f}  "
                  f"median {s['median']:7.1f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
