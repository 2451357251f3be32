"""Where the MLA hook's eager time at T = 128 goes (issue 27, helper mlaloop2), on the H200.

    python3 scripts/gpu/mlaloop2_probe.py [--tokens 1,16,128,512] [--json PATH]

`kvmgr bench peer --halves mla` showed the hook at 20-24 us per call (eager, host) at T = 128
against 9 us at T = 1 / 16, while the stub-driver bench shows no T dependence. Per T (the
peer bench's case: L = 5, R = 512, P = 64, FP8 e4m3 caches of block 64, bf16 rows), the hook
with the same step tensors every call (as the peer bench), with 16 sets of new step tensors
(a serving loop), and through Triton's own launch (``direct_launch=False``, same tensors: the
kernel's device time without the packed launch), this prints, us per call (medians of 7 loops of 200 calls):

- ``loop_host``: wall time of 200 back-to-back calls (the peer bench's host column);
- ``loop_device``: CUDA events around the same loop (the peer bench's eager column);
- ``call_host``: one call timed alone, the queue drained before it (perf_counter and thread CPU
  time): the host path itself, with no queueing behind earlier kernels;
- ``kernel``: CUDA events around one call alone (the kernel's device time, launch latency
  included).

If ``call_host`` is flat in T but ``loop_host`` grows, launches wait in the driver behind
running kernels (device-bound); if ``kernel`` grows to ~``loop_device``, the kernel itself is
the T-dependent part; if ``call_host`` grows, the host path is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvmgr.bench.peer_mla import _BLOCK, _RANK, _ROPE, _step_inputs
from kvmgr.hooks import StepContext
from kvmgr.kernels.mla.hook import GroupedMLAInsertHook

L = 5


def _case(num_tokens: int, direct: bool = True) -> tuple[GroupedMLAInsertHook, list[StepContext]]:
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    sets = [_step_inputs(L, num_tokens, gen) for _ in range(16)]
    num_blocks = sets[0][3]
    caches = [torch.empty(num_blocks, _BLOCK, _RANK + _ROPE, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(L)]  # fmt: skip
    scales = torch.rand(L, device="cuda", generator=gen) * 0.05 + 0.01
    hook = GroupedMLAInsertHook(caches, kv_cache_dtype="fp8_e4m3", kv_scales=scales, direct_launch=direct)  # fmt: skip
    ctxs = [
        StepContext(tensors={"kv_c": kv, "k_pe": pe, "slot_mapping": s}) for kv, pe, s, _ in sets
    ]
    return hook, ctxs


def _loop(
    hook: GroupedMLAInsertHook, ctxs: list[StepContext], calls: int = 200
) -> tuple[float, float]:
    host, device = [], []
    for _ in range(7):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for i in range(calls):
            hook(ctxs[i % len(ctxs)])
        end.record()
        host.append((time.perf_counter() - t0) * 1e6 / calls)
        end.synchronize()
        device.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(host), statistics.median(device)


def _alone(
    hook: GroupedMLAInsertHook, ctxs: list[StepContext], calls: int = 100
) -> tuple[float, float, float]:
    wall, cpu, kernel = [], [], []
    for i in range(calls):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0, c0 = time.perf_counter(), time.thread_time()
        hook(ctxs[i % len(ctxs)])
        wall.append((time.perf_counter() - t0) * 1e6)
        cpu.append((time.thread_time() - c0) * 1e6)
        end.record()
        end.synchronize()
        kernel.append(start.elapsed_time(end) * 1e3)
    return statistics.median(wall), statistics.median(cpu), statistics.median(kernel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,16,128,512")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    print(f"{'T':>5s} {'tensors':8s} {'loop_host':>9s} {'loop_dev':>9s} {'call_host':>9s} {'call_cpu':>9s} {'kernel':>9s}")  # fmt: skip
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        hook, ctxs = _case(num_tokens)
        triton_hook, triton_ctxs = _case(num_tokens, direct=False)
        for mode, use in (("same", ctxs[:1]), ("new", ctxs), ("triton", triton_ctxs[:1])):
            if mode == "triton":
                hook = triton_hook
            for ctx in use * 3:  # warm up: compile, bind, guard
                hook(ctx)
            loop_host, loop_dev = _loop(hook, use)
            call_host, call_cpu, kernel = _alone(hook, use)
            rows.append({"tokens": num_tokens, "tensors": mode, "loop_host_us": loop_host, "loop_device_us": loop_dev,
                         "call_host_us": call_host, "call_cpu_us": call_cpu, "kernel_us": kernel})  # fmt: skip
            print(f"{num_tokens:5d} {mode:8s} {loop_host:9.2f} {loop_dev:9.2f} {call_host:9.2f} {call_cpu:9.2f} {kernel:9.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
