"""``step()`` host time of an old kvmgr tree against this one, in ONE process, step by step.

    python3 scripts/step_cost_ab.py [--old REV] [--repeats 200] [--json out.json]

Issue 27 (helper ``stepcost``). On a loaded 2-core machine two processes differ by more than
the change under test, so both trees run in one process: ``git archive REV kvmgr`` (default:
the merge base of HEAD and ``main``) is unpacked into a temporary folder with the package
renamed ``kvmgr_old`` (every ``kvmgr`` word in its sources rewritten), and each round runs one
step of the old manager and one of the new, alternating which goes first. Both use the fake
CUDA of ``scripts/_fake_cuda.py`` and the stub driver of ``scripts/step_engine_ab.py``
(``fegetround``), so what is timed is kvmgr's Python plus ctypes: 512 queued one-block stores of
48 x 4 KiB pages, the ``cuda`` engine on consecutive GPU ids and the ``kernel`` engine on
scattered ones (``kvmgr bench swap``'s step table).

Per case and tree: ``StepReport.host_s`` (wall) and the thread CPU time of the step's flush
(``time.thread_time_ns``: time other processes take is left out), min / p10 / median in us,
and new / old; then the engine's own share of the step, from its counters (no timer wraps a
function): ``submit`` (``CopyCounters.submit_s``: ``CudaEngine.submit``'s entry to the queued
completion) and ``issue`` (``issue_s``, its issuer's part: descriptor table and driver call, or
the copy kernel's staging, upload and launch), and ``subcpu``: the thread CPU time inside the
engine's ``submit`` (``time.thread_time_ns`` around it, the completion queue's ``put``
included; time other processes take is left out). The recorded stores are prepared (``_settle_deferred``) before the step, as
``bench swap``'s host figure leaves them out too.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import importlib
import io
import json
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import _fake_cuda  # scripts/: this script's folder
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
WHAT = ("host", "cpu", "submit", "issue", "subcpu")  # the figures per case and tree
_ATTR = {"subcpu": "submit_cpu"}


def unpack_old(rev: str, into: Path) -> None:
    """``git archive rev kvmgr`` into ``into/kvmgr_old``, the package name rewritten; from
    ``build/bases/REV/kvmgr`` where that was carried (a checkout without the history)."""
    raw = ROOT / "build" / "bases" / rev / "kvmgr"
    if not raw.is_dir():
        blob = subprocess.run(["git", "archive", rev, "kvmgr"], cwd=ROOT, check=True,
                              capture_output=True).stdout  # fmt: skip
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            tar.extractall(into / "_raw", filter="data")
        raw = into / "_raw" / "kvmgr"
    word = re.compile(r"\bkvmgr\b")
    for path in raw.rglob("*"):
        target = into / "kvmgr_old" / path.relative_to(raw)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.suffix == ".py":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(word.sub("kvmgr_old", path.read_text()))


def old_revision(rev: str | None) -> str:
    """``rev``, or by default the merge base of HEAD and ``main``."""
    if rev:
        return rev
    return subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip


def install_fakes(package: str) -> None:
    """``_fake_cuda.install()``'s patches of host registration and the copy kernel, applied to
    ``package`` (``torch.cuda``'s are shared)."""
    saved = {name: mod for name, mod in sys.modules.items() if name.split(".")[0] == "kvmgr"}
    if package != "kvmgr":  # install() imports "kvmgr...": point those names at the old package
        for name in list(saved):
            del sys.modules[name]
        for name in ("", ".kernels", ".kernels.copy", ".kernels.copy.staging", ".transfer",
                     ".transfer.pinned"):  # fmt: skip
            sys.modules["kvmgr" + name] = importlib.import_module(package + name)
    try:
        _fake_cuda.install()
    finally:
        if package != "kvmgr":
            for name in [n for n in sys.modules if n.split(".")[0] == "kvmgr"]:
                del sys.modules[name]
            sys.modules.update(saved)


def stub_driver(package: str) -> Any:
    """A ``CopyDriver`` of ``package`` whose entry points are libm's ``fegetround``."""
    driver = importlib.import_module(package + ".transfer.driver")
    fn = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6").fegetround
    noop = ctypes.cast(fn, ctypes.c_void_p).value
    return driver.CopyDriver(lambda symbol, version: noop, driver_version=13000)


class Rig:
    """One tree's manager, engine and KV tensors for one case."""

    def __init__(self, package: str, engine_name: str, scattered: bool, swaps: int) -> None:
        kv = importlib.import_module(package)
        engines = importlib.import_module(package + ".transfer.cuda_engine")
        cls = {"cuda": engines.CudaBatchEngine, "kernel": engines.CopyKernelEngine}[engine_name]
        options: dict[str, Any] = {"driver": stub_driver(package), "device": "cuda:0"}
        if engine_name == "kernel":
            options["warmup"] = False
        self.engine = cls(**options)
        tensors = [torch.empty((2 * swaps + 1, 4096), dtype=torch.uint8) for _ in range(48)]
        config = kv.ManagerConfig(num_cpu_blocks=4 * swaps, manage_gpu_blocks=False)
        self.mgr = kv.OffloadManager(tensors, config, engine=self.engine)
        rng = np.random.default_rng(0)
        self.ids = (2 * rng.permutation(swaps) if scattered else np.arange(swaps)).tolist()
        self.host: list[float] = []
        self.cpu: list[float] = []
        self.submit: list[float] = []  # the engine's submit_s and issue_s of the step
        self.issue: list[float] = []
        self.submit_cpu: list[float] = []  # thread CPU time inside engine.submit
        self._submit_cpu = 0.0
        self._flush_cpu = 0.0

    async def start(self) -> None:
        await self.mgr.__aenter__()
        inner = self.mgr._flush

        def timed() -> Any:
            t0 = time.thread_time_ns()
            try:
                return inner()
            finally:
                self._flush_cpu = (time.thread_time_ns() - t0) / 1e3

        self.mgr._flush = timed
        submit = self.engine.submit

        def timed_submit(*args: Any, **kwargs: Any) -> Any:  # the engine's own, in CPU time
            t0 = time.thread_time_ns()
            try:
                return submit(*args, **kwargs)
            finally:
                self._submit_cpu += (time.thread_time_ns() - t0) / 1e3

        self.engine.submit = timed_submit

    async def round(self, r: int, keep: bool) -> None:
        mgr = self.mgr
        counters = self.engine._streams.counters
        submit, issue = counters.submit_s, counters.issue_s
        self._submit_cpu = 0.0
        futures = [mgr.swap_out([g], keys=[f"{r}:{i}".encode()]) for i, g in enumerate(self.ids)]
        mgr._settle_deferred()
        report = await mgr.step()
        await asyncio.gather(*futures)
        if keep:
            self.host.append(report.host_s * 1e6)
            self.cpu.append(self._flush_cpu)
            self.submit.append((counters.submit_s - submit) * 1e6)
            self.issue.append((counters.issue_s - issue) * 1e6)
            self.submit_cpu.append(self._submit_cpu)


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"min": ordered[0], "p10": ordered[len(ordered) // 10],
            "median": statistics.median(ordered)}  # fmt: skip


async def run_case(engine: str, scattered: bool, swaps: int, repeats: int) -> dict[str, Any]:
    """Both trees' figures for one case, rounds interleaved."""
    rigs = {"old": Rig("kvmgr_old", engine, scattered, swaps), "new": Rig("kvmgr", engine, scattered, swaps)}  # fmt: skip
    for rig in rigs.values():
        await rig.start()
    try:
        for r in range(repeats + 5):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for name in order:
                await rigs[name].round(r, keep=r >= 5)
    finally:
        for rig in rigs.values():
            await rig.mgr.__aexit__(None, None, None)
    row: dict[str, Any] = {"engine": engine, "ids": "scattered" if scattered else "consecutive"}
    for what in WHAT:
        old, new = (_stats(getattr(rigs[n], _ATTR.get(what, what))) for n in ("old", "new"))
        row[what] = {"old": old, "new": new, "ratio": {k: new[k] / old[k] for k in old}}
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", default=None, help="old revision (default: merge-base HEAD main)")
    parser.add_argument("--swaps", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--cases", nargs="+", default=["cuda:consecutive", "kernel:scattered"],
        help="ENGINE:IDS cases (engine cuda or kernel; ids consecutive or scattered)",
    )  # fmt: skip
    args = parser.parse_args()
    cases = [(c.split(":")[0], c.split(":")[1] == "scattered") for c in args.cases]
    rev = old_revision(args.old)
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        unpack_old(rev, Path(tmp))
        sys.path.insert(0, tmp)
        install_fakes("kvmgr")
        install_fakes("kvmgr_old")
        rows = [asyncio.run(run_case(e, s, args.swaps, args.repeats))
                for e, s in cases]  # fmt: skip
    print(f"old = {rev[:10]}, new = this tree; {args.repeats} rounds each, interleaved; us")
    for row in rows:
        for what in WHAT:
            old, new, ratio = row[what]["old"], row[what]["new"], row[what]["ratio"]
            print(f"{row['engine']:6s} {row['ids']:11s} {what:6s} "
                  + "  ".join(f"{k} {old[k]:5.1f} -> {new[k]:5.1f} ({ratio[k]:.2f}x)" for k in old))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"old": rev, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
