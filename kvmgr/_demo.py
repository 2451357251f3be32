"""``kvmgr demo``: a store / lookup / load round trip on the host engine, with verified bytes."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys

import torch

from kvmgr.config import ManagerConfig
from kvmgr.manager import OffloadManager


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=8, help="blocks to round-trip (>= 1)")


async def _demo(num_blocks: int) -> int:
    gen = torch.Generator().manual_seed(0)
    # Two KV tensors with different page sizes: [num_gpu_blocks, block_size, head_dim].
    num_gpu = 2 * num_blocks
    gpu = [torch.randn(num_gpu, 16, 36, generator=gen), torch.randn(num_gpu, 16, 8, generator=gen)]
    keys = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(num_blocks)]
    async with OffloadManager(gpu, ManagerConfig(num_cpu_blocks=num_blocks)) as mgr:
        # The manager owns the GPU blocks: a swap names only blocks allocated to a request.
        src = mgr.allocate("first", num_blocks)
        stored = mgr.swap_out(src, keys=keys)
        await mgr.step()
        print("stored:", await stored)
        hits = mgr.lookup(keys)
        dst = mgr.allocate("second", hits)  # a second request with the same prefix
        loaded = mgr.swap_in(keys[:hits], dst)
        await mgr.step()
        print("loaded:", await loaded)
        ok = all(torch.equal(t[src[:hits]], t[dst]) for t in gpu)
        print(f"{hits} blocks verified: {ok}")
        return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    if args.blocks < 1:
        print(f"kvmgr demo: error: --blocks must be >= 1, got {args.blocks}", file=sys.stderr)
        return 2
    return asyncio.run(_demo(args.blocks))
