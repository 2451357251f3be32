"""``kvmgr demo``: a store / lookup / load round trip on the host engine, with verified bytes."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys

import torch

from kvmgr.config import ManagerConfig
from kvmgr.manager import OffloadManager
from kvmgr.reports import SwapResult

#: bytes of one block: two tensors of [16, 36] and [16, 8] float32 pages
_BLOCK_BYTES = 16 * (36 + 8) * 4
#: the largest demo: 2 GPU-side + 1 CPU-side copies of every block stay under ~1 GiB
MAX_BLOCKS = 100_000
#: block ids printed before the rest is summed up as "... (n more)"
_SHOWN = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--blocks", type=int, default=8, help=f"blocks to round-trip (1 to {MAX_BLOCKS})"
    )


def _ids(ids: tuple[int, ...]) -> str:
    shown = ", ".join(map(str, ids[:_SHOWN]))
    return f"[{shown}]" if len(ids) <= _SHOWN else f"[{shown}, ... ({len(ids) - _SHOWN} more)]"


def _summary(result: SwapResult) -> str:
    """One short line for a swap's result, whatever its number of blocks."""
    return (
        f"{result.num_blocks} blocks, {result.num_bytes} B, cpu blocks "
        f"{_ids(result.cpu_block_ids)}, gpu blocks {_ids(result.gpu_block_ids)}"
    )


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
        print("stored:", _summary(await stored))
        hits = mgr.lookup(keys)
        dst = mgr.allocate("second", hits)  # a second request with the same prefix
        loaded = mgr.swap_in(keys[:hits], dst)
        await mgr.step()
        print("loaded:", _summary(await loaded))
        ok = all(torch.equal(t[src[:hits]], t[dst]) for t in gpu)
        print(f"{hits} blocks verified: {ok}")
        return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.blocks <= MAX_BLOCKS:
        print(
            f"kvmgr demo: error: --blocks must be 1 to {MAX_BLOCKS}, got {args.blocks} "
            f"({3 * args.blocks * _BLOCK_BYTES / 2**30:.1f} GiB of host memory)",
            file=sys.stderr,
        )
        return 2
    try:
        return asyncio.run(_demo(args.blocks))
    except (MemoryError, RuntimeError) as exc:  # torch's allocator reports as RuntimeError
        print(f"kvmgr demo: error: could not allocate {args.blocks} blocks: {exc}", file=sys.stderr)
        return 1
