"""The inputs of ``kvmgr bench mla-insert`` and the calls it times (private to
``kvmgr.bench``).

Offers:
    make_sets       rotating input sets of one KV-cache dtype and token count
    variant_calls   per variant, one bound zero-argument insert per set
    bound_calls     one variant's bound calls of an insert function
    TIMED           the variants timed on the device
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TIMED", "bound_calls", "make_sets", "variant_calls"]

_MAX_SETS = 16  # the pointer-table memo must hold every set captured in one graph

#: the variants timed on the device (the others only on the host)
TIMED = ("per_layer", "grouped")


def variant_calls(mla_insert: Any, sets: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Per variant, one bound call per input set: the per-layer and grouped functions, the
    grouped one through Triton's launcher and into one set's caches, and the hook (validated,
    through Triton, unchecked)."""
    grouped = mla_insert.grouped_mla_insert
    return {
        "per_layer": bound_calls(mla_insert.per_layer_mla_insert, sets),
        "grouped": bound_calls(grouped, sets),
        "grouped_triton": bound_calls(functools.partial(grouped, direct_launch=False), sets),
        "grouped_same": bound_calls(grouped, sets, same_caches=True),
        "hook": _hook_calls(sets, validate=True),
        "hook_triton": _hook_calls(sets, validate=True, direct_launch=False),
        "hook_unchecked": _hook_calls(sets),
    }


def make_sets(
    args: argparse.Namespace, kv_cache_dtype: str, num_tokens: int
) -> list[dict[str, Any]]:
    """Rotating input sets: random non-zero inputs, shuffled blocks filled in token order."""
    dtype = getattr(torch, args.dtype)
    cache_dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(
        kv_cache_dtype, dtype
    )
    layers, rank, rope = args.layers, args.rank, args.rope_dim
    width = rank + rope
    num_bytes = (
        layers * num_tokens * width * (dtype.itemsize + cache_dtype.itemsize) + num_tokens * 8
    )
    num_sets = max(1, min(_MAX_SETS, math.ceil(args.rotate_mib * 2**20 / num_bytes)))
    cpu_gen = torch.Generator().manual_seed(args.seed + num_tokens)
    gens = cpu_gen, torch.Generator(device="cuda").manual_seed(args.seed + num_tokens)
    return [
        _one_set(args, dtype, cache_dtype, kv_cache_dtype, num_tokens, gens, num_bytes)
        for _ in range(num_sets)
    ]


def _one_set(
    args: argparse.Namespace, dtype: torch.dtype, cache_dtype: torch.dtype, kv_cache_dtype: str,
    num_tokens: int, gens: tuple[torch.Generator, torch.Generator], num_bytes: int,
) -> dict[str, Any]:  # fmt: skip
    """One input set: ``kv_c``/``k_pe`` random non-zero, one cache per layer, the slots of
    shuffled blocks filled in token order, scales for fp8 caches."""
    cpu_gen, gpu_gen = gens
    layers, rank, block = args.layers, args.rank, args.block_size
    width, num_blocks = rank + args.rope_dim, math.ceil(num_tokens / block)
    both = torch.randn(layers, num_tokens, width, device="cuda", generator=gpu_gen) * 4 + 0.5
    order = torch.randperm(num_blocks, generator=cpu_gen)
    token_ids = torch.arange(num_tokens)
    slots = (order[token_ids // block] * block + token_ids % block).cuda()
    scales = None
    if kv_cache_dtype != "auto":
        scales = torch.rand(layers, device="cuda", generator=gpu_gen) * 0.1 + 0.01
    return {
        "kv_c": both[..., :rank].to(dtype).contiguous(),
        "k_pe": both[..., rank:].to(dtype).contiguous(),
        "caches": [
            torch.empty(num_blocks, block, width, device="cuda", dtype=cache_dtype)
            for _ in range(layers)
        ],
        "slots": slots,
        "kwargs": {"kv_cache_dtype": kv_cache_dtype, "kv_scales": scales},
        "bytes": num_bytes,
    }


def bound_calls(
    fn: Callable[..., None], sets: list[dict[str, Any]], *, same_caches: bool = False, **tuning: Any
) -> list[Any]:
    """One zero-argument insert per set, arguments bound up front (``same_caches``: every call
    into the first set's caches)."""
    calls = []
    for s in sets:
        caches = sets[0]["caches"] if same_caches else s["caches"]
        calls.append(functools.partial(fn, s["kv_c"], s["k_pe"], caches, s["slots"], **s["kwargs"], **tuning))  # fmt: skip
    return calls


def _hook_calls(sets: list[dict[str, Any]], **options: Any) -> list[Any]:
    """One ``GroupedMLAInsertHook`` call per set (default ``validate=False``), context prebuilt."""
    from kvmgr.hooks import StepContext
    from kvmgr.kernels.mla.hook import GroupedMLAInsertHook

    calls = []
    for s in sets:
        hook = GroupedMLAInsertHook(s["caches"], **{"validate": False, **options}, **s["kwargs"])
        tensors = {"kv_c": s["kv_c"], "k_pe": s["k_pe"], "slot_mapping": s["slots"]}
        calls.append(functools.partial(hook, StepContext(tensors=tensors)))
    return calls
