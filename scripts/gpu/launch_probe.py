"""Where a packed launch's host time goes on a GPU machine: the driver call vs the Python around it.

    python3 scripts/gpu/launch_probe.py [--calls 2000]

One tiny Triton kernel (one program storing one int), bound once as a packed launch; then host us
per call (wall clock, median of 9 runs; the device is synchronized every 200 calls so the launch
queue never fills) of:

- ``PackedLaunch.launch``: what every kvmgr hook step pays for one launch (Python + driver);
- the C call alone (``kvmgr.kernels.launch.native``'s ``fire`` of the same record);
- ``cuLaunchKernelEx`` through ctypes, the call kvmgr made before;
- ``cuLaunchKernel`` through ctypes with the same parameters (the older entry point).

The difference between the last three is the call path; what they share is the driver's own time.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvmgr.kernels.launch import Launcher
from kvmgr.kernels.launch.native import native_fire


@triton.jit
def _touch(x_ptr, n):
    i = tl.program_id(0)
    if i < n:
        tl.store(x_ptr + i, i)


def _us(fn: Callable[[], object], calls: int) -> float:
    runs = []
    for _ in range(9):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for done in range(calls):
            fn()
            if done % 200 == 199:
                torch.cuda.synchronize()
        runs.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    x = torch.full((16,), -1, device="cuda", dtype=torch.int32)
    bound = Launcher(_touch).bind((1, 1, 1), x, 1)
    assert bound.is_packed, "no packed launch on this machine"
    bound.launch((1, 1, 1))
    torch.cuda.synchronize()
    assert x[0].item() == 0, "the packed launch did not run"
    lib = ctypes.CDLL("libcuda.so.1")
    ex, plain = lib.cuLaunchKernelEx, lib.cuLaunchKernel
    ex.restype = plain.restype = ctypes.c_int
    config, function, params, _ = bound._call
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    grid = (1, 1, 1)
    bound.launch(grid)  # the header now holds this grid and stream
    plain_args = (function, 1, 1, 1, bound._block, 1, 1, bound._shared, stream, params, None)
    rows = {"PackedLaunch.launch (Python + driver)": lambda: bound.launch(grid)}
    fire = native_fire()
    if fire is not None and bound._record_address is not None:
        record = bound._record_address
        rows["C call alone (native fire)"] = lambda: fire(record)
    rows["cuLaunchKernelEx through ctypes"] = lambda: ex(config, function, params, None)
    rows["cuLaunchKernel through ctypes"] = lambda: plain(*plain_args)
    for name, fn in rows.items():
        assert fn() in (None, 0), name
        print(f"{name:45s} {_us(fn, args.calls):7.2f} us per call")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
