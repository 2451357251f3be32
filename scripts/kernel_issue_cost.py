"""Host cost of one copy-kernel store on CPU: ``build_plan`` + ``KernelCopy.issue`` staging.

    python3 scripts/kernel_issue_cost.py [--blocks 512] [--tensors 48] [--repeats 300]

Runs ``KernelCopy`` without a GPU: table slots are plain CPU tensors, the driver's upload
(``cuMemcpyAsync``) is a no-op and the kernel launches are no-ops, so it measures the host work of
a step's store except the real driver call and launch: planning, table staging, the issuer's
choice of path. Prints the minimum and median (us) of ``build_plan``, of ``issue`` and of both, for
``--blocks`` consecutive and scattered block ids of ``--tensors`` x 4 KiB pages.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from kvmgr.kernels.copy import staging
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer import kernel
from kvmgr.transfer.plan import Direction, build_plan


class _Stream:
    cuda_stream = 0x1234


class _Driver:
    def memcpy(self, dst: int, src: int, num_bytes: int, stream: int) -> None:
        pass


def _cpu_slot(capacity: int, device: Any) -> staging.TableSlot:
    host, table = (torch.zeros(3 * capacity, dtype=torch.int64) for _ in range(2))
    return staging.TableSlot(capacity, host, host.numpy(), table, host.data_ptr(), table.data_ptr())


def _stub_cuda() -> None:
    torch.cuda.stream = lambda stream: contextlib.nullcontext()  # type: ignore[assignment]
    staging.new_table_slot = _cpu_slot  # type: ignore[assignment]
    for name in ("launch_copy_table", "launch_block_table"):  # the descriptor and paged launches
        setattr(staging, name, lambda *args, **kw: 1)


def _case(blocks: int, tensors: int, scattered: bool, repeats: int) -> dict[str, list[float]]:
    gpu = [torch.empty((2 * blocks + 1, 4096), dtype=torch.uint8) for _ in range(tensors)]
    cpu = [torch.empty((4 * blocks, 4096), dtype=torch.uint8) for _ in range(tensors)]
    src, dst = KVLayout.from_tensors(gpu), KVLayout.from_tensors(cpu)
    rng = np.random.default_rng(0)
    gpu_ids = 2 * rng.permutation(blocks) if scattered else np.arange(blocks)
    cpu_ids = rng.permutation(4 * blocks)[:blocks] if scattered else np.arange(blocks)
    issuer = kernel.KernelCopy(torch.device("cpu"), _Driver())  # type: ignore[arg-type]
    stream = _Stream()
    times: dict[str, list[float]] = {"build_plan": [], "issue": [], "both": []}
    for r in range(repeats + 20):
        t0 = time.perf_counter()
        plan = build_plan(Direction.D2H, src, dst, gpu_ids, cpu_ids)
        t1 = time.perf_counter()
        issued = issuer.issue(plan, stream)
        t2 = time.perf_counter()
        assert issued.error is None, issued.error
        if issued.release is not None:
            issued.release()
        if r >= 20:
            times["build_plan"].append((t1 - t0) * 1e6)
            times["issue"].append((t2 - t1) * 1e6)
            times["both"].append((t2 - t0) * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--tensors", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    _stub_cuda()
    for scattered in (False, True):
        times = _case(args.blocks, args.tensors, scattered, args.repeats)
        ids = "scattered" if scattered else "consecutive"
        cells = "  ".join(
            f"{k} {min(v):6.1f} / {statistics.median(v):6.1f}" for k, v in times.items()
        )
        print(f"{ids:11s} (min / median us)  {cells}")


if __name__ == "__main__":
    main()
