"""``OffloadManager.step()`` host time on the host engine (CPU only), for issue 12.

    python3 scripts/host_step_time.py [--swaps 512] [--repeats 30]

Queues ``--swaps`` one-block stores of 48 x 4 KiB pages (consecutive or scattered GPU ids), times
one ``step()`` (``StepReport.host_s``), awaits the copies, and prints the median and minimum per id
pattern, plus the time from the first ``swap_out`` call to the last future resolved.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from kvmgr import ManagerConfig, OffloadManager


async def _case(swaps: int, repeats: int, scattered: bool) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    kv = [torch.randint(0, 256, (2 * swaps + 1, 4096), dtype=torch.uint8, generator=gen)
          for _ in range(48)]  # fmt: skip
    config = ManagerConfig(num_cpu_blocks=4 * swaps, engine="host", manage_gpu_blocks=False)
    ids = 2 * np.random.default_rng(0).permutation(swaps) if scattered else np.arange(swaps)
    host, landed = [], []
    async with OffloadManager(kv, config) as mgr:
        for r in range(repeats + 3):
            t0 = time.perf_counter()
            futures = [
                mgr.swap_out([int(g)], keys=[f"{r}:{i}".encode()]) for i, g in enumerate(ids)
            ]
            report = await mgr.step()
            await asyncio.gather(*futures)
            if r >= 3:
                host.append(report.host_s * 1e6)
                landed.append((time.perf_counter() - t0) * 1e6)
            mgr.clear() if hasattr(mgr, "clear") else None
    return {"median_us": statistics.median(host), "min_us": min(host),
            "landed_median_us": statistics.median(landed)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--swaps", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    for scattered in (False, True):
        row = asyncio.run(_case(args.swaps, args.repeats, scattered))
        name = "scattered" if scattered else "consecutive"
        print(f"{name:12s} step host us: median {row['median_us']:.0f}, min {row['min_us']:.0f}; "
              f"swap_out -> landed median {row['landed_median_us']:.0f} us")  # fmt: skip


if __name__ == "__main__":
    main()
