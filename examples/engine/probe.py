"""One prefix hit, timed three ways in one process: load alone, suffix compute alone, layerwise.

Offers:
    hit_probe   ``await hit_probe(model, kv, ...)`` -> the three times and the layerwise ratio

Issue 24's TTFT goal for a hit: with layerwise loading, the hit's prefill step (load of the
prefix + compute of the suffix) takes <= 1.1x max(its load time, its suffix compute time). The
probe measures exactly those on the run's model and KV tensors: ``prefix_blocks`` blocks stored
in the CPU tier, then (a) ``load_many`` of the prefix and its wait, (b) the suffix's forward
over the loaded prefix, (c) ``load_layerwise`` + the same forward with ``wait_layer`` before each
layer's attention. Wall times with a device synchronize at the end of each, medians of
``repeats``. ``ratio`` = c / max(a, b).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from typing import Any

import numpy as np
import torch

from examples.engine.model import PagedDecoder, StepBatch
from kvmgr import ManagerConfig, OffloadManager

__all__ = ["hit_probe"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(prefix_tokens: int, suffix: int, table: np.ndarray, block_size: int, vocab: int,
           device: torch.device) -> StepBatch:  # fmt: skip
    pos = np.arange(prefix_tokens, prefix_tokens + suffix)
    slots = table[pos // block_size] * block_size + pos % block_size
    ids = np.random.default_rng(1).integers(1, vocab, suffix)
    return StepBatch(
        input_ids=torch.from_numpy(ids).to(device),
        positions=torch.from_numpy(pos).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc=[0, suffix],
        context_lens=[prefix_tokens + suffix],
        block_tables=torch.from_numpy(table[None, :].copy()).to(device),
        num_decodes=0,
        sample_rows=torch.tensor([suffix - 1], device=device),
    )


async def hit_probe(
    model: PagedDecoder,
    kv: list[torch.Tensor],
    *,
    block_size: int,
    prefix_blocks: int,
    suffix_tokens: int,
    engine: str = "auto",
    repeats: int = 3,
    max_groups: int = 8,
) -> dict[str, Any]:
    """Time one hit three ways (module docstring); returns seconds and ``ratio``."""
    device = kv[0].device
    suffix_blocks = -(-suffix_tokens // block_size)
    config = ManagerConfig(num_cpu_blocks=prefix_blocks + 1, engine=engine)  # type: ignore[arg-type]
    keys = [hashlib.blake2b(b"probe" + i.to_bytes(4, "little")).digest() for i in range(prefix_blocks)]  # fmt: skip
    times: dict[str, list[float]] = {"load_s": [], "compute_s": [], "layerwise_s": []}
    async with OffloadManager(kv, config) as mgr:
        src = mgr.allocate("src", prefix_blocks)
        stored = mgr.store_many(src, keys)
        await mgr.step()
        await stored
        table = np.asarray(mgr.allocate("dst", prefix_blocks + suffix_blocks), dtype=np.int64)
        batch = _batch(prefix_blocks * block_size, suffix_tokens, table, block_size,
                       model.config.vocab_size, device)  # fmt: skip
        prefix = table[:prefix_blocks]
        model(batch, kv)  # warm-up at this shape
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            loaded = mgr.load_many(keys, prefix)
            await mgr.step()
            await loaded
            _sync(device)
            t1 = time.perf_counter()
            model(batch, kv)
            _sync(device)
            t2 = time.perf_counter()
            load = mgr.load_layerwise(keys, prefix, layers=2, max_groups=max_groups)
            model(batch, kv, load.wait_layer)
            _sync(device)
            await load
            t3 = time.perf_counter()
            times["load_s"].append(t1 - t0)
            times["compute_s"].append(t2 - t1)
            times["layerwise_s"].append(t3 - t2)
        mgr.free("src")
        mgr.free("dst")
    result: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    result["ratio"] = result["layerwise_s"] / max(result["load_s"], result["compute_s"])
    result |= {"prefix_blocks": prefix_blocks, "suffix_tokens": suffix_tokens, "engine": engine,
               "max_groups": max_groups}  # fmt: skip
    return result
