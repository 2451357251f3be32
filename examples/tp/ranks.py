"""The rank factory of the TP example: each rank's half of the KV heads and its worker.

``make_rank`` runs once in each rank process (``kvmgr.transport.RankGroup`` forks the ranks
from a fork server that imports this module by name, so it must live in a module, not in the
script that starts the group). On a machine with as many GPUs as ranks it puts rank ``r``'s KV
on ``cuda:r`` with the engine ``"auto"``; elsewhere on CPU tensors with the host engine.
"""

from __future__ import annotations

import torch

from kvmgr.transfer import HostEngine, make_engine
from kvmgr.worker import TransferWorker

NUM_GPU_BLOCKS, NUM_CPU_BLOCKS, HEADS, LAYERS = 64, 256, 8, 2


def make_rank(rank: int, num_ranks: int) -> TransferWorker:
    """Rank ``rank`` of ``num_ranks``: K and V of ``LAYERS`` layers, ``HEADS / num_ranks`` heads
    each, fp16 ``[NUM_GPU_BLOCKS, 16 tokens, heads, 128]``; its own CPU tier."""
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= num_ranks
    device = torch.device(f"cuda:{rank}" if on_gpu else "cpu")
    shape = (NUM_GPU_BLOCKS, 16, HEADS // num_ranks, 128)
    gen = torch.Generator().manual_seed(rank)
    kv = [torch.randn(shape, generator=gen).half().to(device) for _ in range(2 * LAYERS)]
    engine = make_engine("auto", device) if on_gpu else HostEngine()
    return TransferWorker(kv, NUM_CPU_BLOCKS, engine, rank=rank, num_ranks=num_ranks)
