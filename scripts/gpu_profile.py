"""Where the host time of the engine submit path and the kernel hooks goes (H200, ad hoc).

Prints micro-timings of the torch/driver primitives the submit path uses, then cProfile
(tottime) of ``OffloadManager.step()`` with 512 queued 48-tensor stores per engine, and of the
MLA and c128 hooks. Not a benchmark: an aid for choosing what to cut.
"""

# ruff: noqa: B023  (the lambdas are timed inside the loop iteration that made them)

from __future__ import annotations

import asyncio
import concurrent.futures
import cProfile
import ctypes
import io
import pstats
import statistics
import sys
import time

import numpy as np
import torch


def us(fn, n=3000):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) * 1e6 / n)
        torch.cuda.synchronize()
    return statistics.median(runs)


def micro() -> None:
    s = torch.cuda.Stream()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(s)
    tiny = torch.zeros(4, device="cuda")
    rows = [
        ("Event(timing) create", lambda: torch.cuda.Event(enable_timing=True)),
        ("Event create+record", lambda: torch.cuda.Event(enable_timing=True).record(s)),
        (
            "Event(blocking) create+record",
            lambda: torch.cuda.Event(enable_timing=True, blocking=True).record(s),
        ),
        ("event.record(existing)", lambda: ev.record(s)),
        ("stream.wait_event", lambda: s.wait_event(ev)),
        ("current_stream()", lambda: torch.cuda.current_stream()),
        ("current_device()", lambda: torch.cuda.current_device()),
        ("with torch.cuda.stream(s)", lambda: torch.cuda.stream(s).__enter__() or None),
        ("s.cuda_stream", lambda: s.cuda_stream),
        ("_cuda_getCurrentRawStream", lambda: torch._C._cuda_getCurrentRawStream(0)),
        ("cf.Future()", concurrent.futures.Future),
        ("tiny add_", lambda: tiny.add_(1)),
        ("event.query()", ev.query),
    ]
    for name, fn in rows:
        if name.startswith("with"):
            ctx = torch.cuda.stream(s)

            def fn(ctx=ctx):
                with torch.cuda.stream(s):
                    pass

        print(f"micro {name:34s} {us(fn):7.2f} us", flush=True)
    # raw driver launch floor: libcuda via CDLL (GIL released) and PyDLL (kept)
    from kvmgr.kernels.copy.pages import launch_copy_table

    table = torch.zeros(3 * 64, dtype=torch.int64, device="cuda")
    print(
        f"micro {'launch_copy_table n=0-size rows':34s} {us(lambda: launch_copy_table(table, 64, 8)):7.2f} us"
    )


def step_profile(engine: str, scattered: bool) -> None:
    from kvmgr import ManagerConfig, OffloadManager

    swaps, tensors, page = 512, 48, 4096
    gpu = [
        torch.randint(0, 256, (2 * swaps + 1, page), dtype=torch.uint8, device="cuda")
        for _ in range(tensors)
    ]
    cfg = ManagerConfig(num_cpu_blocks=8 * swaps, engine=engine, manage_gpu_blocks=False)
    rng = np.random.default_rng(0)
    ids = 2 * rng.permutation(swaps) if scattered else np.arange(swaps)

    async def main() -> None:
        prof = cProfile.Profile()
        hosts = []
        async with OffloadManager(gpu, cfg) as mgr:
            for r in range(25):
                futs = [
                    mgr.swap_out([int(g)], keys=[f"{r}:{i}".encode()]) for i, g in enumerate(ids)
                ]
                if r >= 5:
                    prof.enable()
                rep = await mgr.step()
                if r >= 5:
                    prof.disable()
                    hosts.append(rep.host_s * 1e6)
                await asyncio.gather(*futs)
                if r % 7 == 6:
                    mgr.clear()
            # unprofiled
            plain = []
            for r in range(25, 45):
                futs = [
                    mgr.swap_out([int(g)], keys=[f"{r}:{i}".encode()]) for i, g in enumerate(ids)
                ]
                before = mgr.engine.statistics()
                rep = await mgr.step()
                after = mgr.engine.statistics()
                plain.append(
                    (
                        rep.host_s * 1e6,
                        (after.submit_s - before.submit_s) * 1e6,
                        (after.issue_s - before.issue_s) * 1e6,
                    )
                )
                await asyncio.gather(*futs)
                if r % 7 == 6:
                    mgr.clear()
        med = [statistics.median(x) for x in zip(*plain)]
        print(
            f"== step {engine} {'scattered' if scattered else 'consecutive'}: host {med[0]:.0f} engine {med[1]:.0f} issue {med[2]:.0f} us (unprofiled medians); profiled host {statistics.median(hosts):.0f}"
        )
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(28)
        print(out.getvalue()[-6000:], flush=True)

    asyncio.run(main())


def hook_profiles() -> None:
    from kvmgr.hooks import StepContext
    from kvmgr.kernels.mla.hook import GroupedMLAInsertHook

    L, T, R, P = 5, 16, 512, 64
    for dtype in ("auto", "fp8_e4m3"):
        cache_dtype = torch.float8_e4m3fn if dtype != "auto" else torch.bfloat16
        caches = [torch.empty(64, 64, R + P, device="cuda", dtype=cache_dtype) for _ in range(L)]
        kv = torch.randn(L, T, R, device="cuda").bfloat16()
        pe = torch.randn(L, T, P, device="cuda").bfloat16()
        slots = torch.randperm(64 * 64, device="cuda")[:T]
        scales = None if dtype == "auto" else torch.rand(L, device="cuda") + 0.1
        hook = GroupedMLAInsertHook(caches, kv_cache_dtype=dtype, kv_scales=scales, validate=False)
        ctx = StepContext(tensors={"kv_c": kv, "k_pe": pe, "slot_mapping": slots})
        ins = hook._insert
        hook(ctx)
        bound, grid = ins._last[-1], ins._last[5]
        print(
            f"== mla {dtype}: hook {us(lambda: hook(ctx)):.2f} us; GroupedInsert {us(lambda: ins(kv, pe, slots, scales)):.2f}; bound.launch {us(lambda: bound.launch(grid, None)):.2f}; raw driver call {us(lambda: bound._driver.launch(*bound._call)):.2f}"
        )
        from kvmgr.hooks import HookReport

        print(
            f"   HookReport() {us(lambda: HookReport(name='x', launches=1, host_s=0.0, extra={'num_tokens': 1, 'grouped': True})):.2f} us"
        )
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5000):
            hook(ctx)
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
        print(out.getvalue()[-2500:], flush=True)
    # raw driver floor with PyDLL (GIL kept)
    lib = ctypes.PyDLL("libcuda.so.1")
    fn = lib.cuLaunchKernelEx
    fn.restype = ctypes.c_int
    print(f"   raw driver call via PyDLL {us(lambda: fn(*bound._call)):.2f} us")


def dma_caps() -> None:
    """The batch-DMA engine on 512 scattered blocks of 64 x 32 KiB, descriptor cap per call
    8,192 (the default) vs one call for the whole plan, alternated in one process."""
    from kvmgr.pool.layout import KVLayout
    from kvmgr.transfer.cuda_engine import CudaBatchEngine
    from kvmgr.transfer.plan import Direction, build_plan

    tensors, blocks, page = 64, 512, 32 << 10
    gpu = [
        torch.randint(0, 256, (2 * blocks + 1, page), dtype=torch.uint8, device="cuda")
        for _ in range(tensors)
    ]
    engines = {
        cap: CudaBatchEngine(device=torch.device("cuda", 0), max_descriptors=cap)
        for cap in (8192, 1 << 20)
    }
    host = engines[8192].allocate_host(tensors * blocks * page).view(tensors, blocks, page)
    gl, hl = KVLayout.from_tensors(gpu), KVLayout.from_tensors(list(host.unbind(0)))
    rng = np.random.default_rng(0)
    src, dst = 2 * rng.permutation(blocks), rng.permutation(blocks)
    times: dict[int, list[float]] = {cap: [] for cap in engines}
    for rep in range(12):
        for cap, engine in engines.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            plan = build_plan(Direction.D2H, gl, hl, src, dst)
            engine.submit(plan).future.result(timeout=60)
            if rep >= 2:
                times[cap].append((time.perf_counter() - t) * 1e6)
    for cap, values in times.items():
        print(
            f"== dma 64 x 32 KiB D2H cap {cap}: median {statistics.median(values):.0f} us, min {min(values):.0f}"
        )
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    what = sys.argv[1:] or ["micro", "step", "hooks"]
    if "micro" in what:
        micro()
    if "hooks" in what:
        hook_profiles()
    if "dma" in what:
        dma_caps()
    if "step" in what:
        for engine, scattered in (("cuda", False), ("kernel", True), ("kernel", False)):
            step_profile(engine, scattered)
