"""Grouped / per-layer MLA cache insert against the torch reference.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` (set by conftest, which also routes the
interpreter's float -> FP8 conversion through torch), so FP8 results are compared byte for byte.
Caches start as random bytes ("poison"): rows the step does not map must keep them exactly.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from triton.runtime.jit import JITFunction

from kvmgr import _tensor_guard
from kvmgr.bench import mla_insert as bench
from kvmgr.errors import ConfigError, GeometryError, InvalidBlockError
from kvmgr.hooks import StepContext, StepHook
from kvmgr.kernels.launch import rule, shared_launcher
from kvmgr.kernels.mla import api, memo, plan
from kvmgr.kernels.mla import kernel as mla_kernel
from kvmgr.kernels.mla.api import grouped_mla_insert, per_layer_mla_insert
from kvmgr.kernels.mla.hook import GroupedMLAInsertHook
from kvmgr.kernels.mla.insert import GroupedInsert
from kvmgr.kernels.mla.reference import mla_insert_reference

KERNELS = {"grouped": grouped_mla_insert, "per_layer": per_layer_mla_insert}
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
INPUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(
    seed: int, num_layers: int, num_tokens: int, rank: int, rope_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random non-zero kv_c, k_pe; about 1 value in 8 is tiny (FP8 subnormal range)."""
    gen = torch.Generator().manual_seed(seed)
    both = torch.randn(num_layers, num_tokens, rank + rope_dim, generator=gen) * 8
    tiny = torch.rand(both.shape, generator=gen) < 0.125
    both = torch.where(tiny, both * 1e-3, both).to(dtype).to(DEVICE)
    return both[..., :rank].contiguous(), both[..., rank:].contiguous()


def _caches(
    seed: int, num_layers: int, num_blocks: int, block_size: int, width: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Caches filled with random bytes (the poison)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, width * dtype.itemsize)
    return [
        torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(DEVICE).view(dtype)
        for _ in range(num_layers)
    ]


def _slots(seed: int, num_tokens: int, capacity: int, num_padding: int) -> torch.Tensor:
    """Distinct random slots with ``num_padding`` of them replaced by -1."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(capacity, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:num_padding]] = -1
    return slots.to(DEVICE)


def _scales(seed: int, num_layers: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(num_layers, generator=gen) * 0.5 + 0.02).to(DEVICE)


def _same_bytes(left: Sequence[torch.Tensor], right: Sequence[torch.Tensor]) -> bool:
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(left, right, strict=True))  # fmt: skip


def _reference(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    caches: list[torch.Tensor],
    slots: torch.Tensor,
    **kwargs: object,
) -> list[torch.Tensor]:
    """Clones of ``caches`` after the torch reference's insert (``caches`` untouched)."""
    expected = [cache.clone() for cache in caches]
    mla_insert_reference(kv_c, k_pe, expected, slots, **kwargs)  # type: ignore[arg-type]
    return expected


def _run_both(
    kernel: Callable[..., None],
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    caches: list[torch.Tensor],
    slots: torch.Tensor,
    **kwargs: object,
) -> list[torch.Tensor]:
    """Run ``kernel`` on ``caches`` and the reference on clones; return the reference's caches."""
    expected = _reference(kv_c, k_pe, caches, slots, **kwargs)
    kernel(kv_c, k_pe, caches, slots, **kwargs)
    return expected


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_kernel_matches_reference_byte_for_byte(
    kernel: Callable[..., None], dtype: torch.dtype, kv_cache_dtype: str
) -> None:
    # Irregular sizes: R and P not powers of two, T not a multiple of any tile.
    num_layers, num_tokens, rank, rope_dim, num_blocks, block_size = 3, 21, 40, 12, 9, 4
    kv_c, k_pe = _inputs(1, num_layers, num_tokens, rank, rope_dim, dtype)
    cache_dtype = FP8_DTYPES.get(kv_cache_dtype, dtype)
    caches = _caches(2, num_layers, num_blocks, block_size, rank + rope_dim, cache_dtype)
    slots = _slots(3, num_tokens, num_blocks * block_size, num_padding=4)
    scales = None if kv_cache_dtype == "auto" else _scales(4, num_layers)
    expected = _run_both(
        kernel, kv_c, k_pe, caches, slots, kv_cache_dtype=kv_cache_dtype, kv_scales=scales
    )
    assert _same_bytes(caches, expected)


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
def test_valid_slots_written_and_everything_else_keeps_its_poison(
    kernel: Callable[..., None],
) -> None:
    # Checked without the reference: each mapped row holds its token, every other byte is poison.
    num_layers, num_tokens, rank, rope_dim, num_blocks, block_size = 2, 17, 24, 8, 7, 3
    kv_c, k_pe = _inputs(5, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
    caches = _caches(6, num_layers, num_blocks, block_size, rank + rope_dim, torch.bfloat16)
    poison = [cache.clone() for cache in caches]
    slots = _slots(7, num_tokens, num_blocks * block_size, num_padding=5)
    kernel(kv_c, k_pe, caches, slots)
    for layer in range(num_layers):
        flat, before = caches[layer].reshape(-1, rank + rope_dim), poison[layer].reshape(-1, rank + rope_dim)  # fmt: skip
        written = torch.zeros(flat.shape[0], dtype=torch.bool, device=flat.device)
        for token, slot in enumerate(slots.tolist()):
            if slot >= 0:
                row = torch.cat([kv_c[layer, token], k_pe[layer, token]])
                assert torch.equal(flat[slot].view(torch.int16), row.view(torch.int16))
                written[slot] = True
        assert int(written.sum()) == num_tokens - 5
        assert torch.equal(flat[~written].view(torch.int16), before[~written].view(torch.int16))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_rounds_to_nearest_even_and_saturates(kv_cache_dtype: str) -> None:
    # Scale 1: ties (17 -> 16 in e4m3), subnormals, overflow (saturates to +-max), plain values.
    fp8 = FP8_DTYPES[kv_cache_dtype]
    edges = [17.0, 19.0, -17.0, 2.0**-9, 3 * 2.0**-10, 2.0**-17, 500.0, -1e9, 1e9, 0.3, 100.0, 2.5]
    rank, rope_dim = 12, 4
    row = torch.tensor(edges + [1.0] * (rank + rope_dim - len(edges)), dtype=torch.float32)
    kv_c, k_pe = row[:rank].reshape(1, 1, rank).to(DEVICE), row[rank:].reshape(1, 1, rope_dim).to(DEVICE)  # fmt: skip
    caches = _caches(8, 1, 2, 2, rank + rope_dim, fp8)
    slots = torch.tensor([3], device=DEVICE)
    scales = torch.ones(1, device=DEVICE)
    grouped_mla_insert(kv_c, k_pe, caches, slots, kv_cache_dtype=kv_cache_dtype, kv_scales=scales)
    limit = torch.finfo(fp8).max
    want = row.clamp(-limit, limit).to(fp8).view(torch.uint8)
    assert torch.equal(caches[0][1, 1].view(torch.uint8).cpu(), want)
    if kv_cache_dtype == "fp8_e4m3":  # independent of torch: 17 is a tie between 16 and 18
        assert caches[0][1, 1, 0].view(torch.uint8).item() == 0x58  # 16.0
        assert caches[0][1, 1, 8].view(torch.uint8).item() == 0x7E  # saturated +448


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
def test_per_layer_slot_mapping_and_stride0_expand(kernel: Callable[..., None]) -> None:
    num_layers, num_tokens, rank, rope_dim, num_blocks, block_size = 3, 11, 16, 8, 5, 4
    kv_c, k_pe = _inputs(9, num_layers, num_tokens, rank, rope_dim, torch.float16)
    # [L, T]: every layer has its own slots.
    per_layer = torch.stack([_slots(10 + i, num_tokens, num_blocks * block_size, 2) for i in range(num_layers)])  # fmt: skip
    caches = _caches(11, num_layers, num_blocks, block_size, rank + rope_dim, torch.float8_e4m3fn)
    scales = _scales(12, num_layers)
    kwargs = {"kv_cache_dtype": "fp8_e4m3", "kv_scales": scales}
    expected = _run_both(kernel, kv_c, k_pe, caches, per_layer, **kwargs)
    assert _same_bytes(caches, expected)
    # A stride-0 expand of a shared [T] mapping gives what the shared mapping gives.
    shared = per_layer[0]
    expanded_caches = _caches(13, num_layers, num_blocks, block_size, rank + rope_dim, torch.uint8)
    shared_caches = [cache.clone() for cache in expanded_caches]
    kernel(kv_c, k_pe, expanded_caches, shared.expand(num_layers, -1), **kwargs)
    kernel(kv_c, k_pe, shared_caches, shared, **kwargs)
    assert _same_bytes(expanded_caches, shared_caches)
    assert not _same_bytes(expanded_caches, _caches(13, num_layers, num_blocks, block_size, rank + rope_dim, torch.uint8))  # fmt: skip


def test_strided_inputs_and_caches() -> None:
    # kv_c / k_pe as slices of one fused projection, caches as views with padded rows.
    num_layers, num_tokens, rank, rope_dim, num_blocks, block_size = 2, 9, 32, 16, 4, 4
    gen = torch.Generator().manual_seed(14)
    fused = (torch.randn(num_layers, num_tokens, rank + rope_dim + 8, generator=gen) + 3).to(DEVICE)
    kv_c, k_pe = fused[..., :rank], fused[..., rank + 8 :]
    wide = _caches(15, num_layers, num_blocks, block_size, rank + rope_dim + 16, torch.float32)
    caches = [cache[..., : rank + rope_dim] for cache in wide]
    slots = _slots(16, num_tokens, num_blocks * block_size, 2)
    expected = _run_both(grouped_mla_insert, kv_c, k_pe, caches, slots)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(caches, expected, strict=True))  # fmt: skip
    assert torch.equal(wide[0][..., rank + rope_dim :], _caches(15, num_layers, num_blocks, block_size, rank + rope_dim + 16, torch.float32)[0][..., rank + rope_dim :])  # fmt: skip


def test_grouped_equals_per_layer_and_per_layer_takes_unequal_caches() -> None:
    num_layers, num_tokens, rank, rope_dim = 3, 13, 16, 8
    kv_c, k_pe = _inputs(17, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
    slots = _slots(18, num_tokens, 16, 3)
    grouped = _caches(19, num_layers, 4, 4, rank + rope_dim, torch.float8_e5m2)
    per_layer = [cache.clone() for cache in grouped]
    kwargs = {"kv_cache_dtype": "fp8_e5m2", "kv_scales": _scales(20, num_layers)}
    grouped_mla_insert(kv_c, k_pe, grouped, slots, **kwargs)
    per_layer_mla_insert(kv_c, k_pe, per_layer, slots, **kwargs)
    assert _same_bytes(grouped, per_layer)
    # Layers with different num_blocks / block_size: grouped refuses, per-layer matches the reference.
    mixed = [_caches(21 + i, 1, 4 + 4 * i, 4 // (i + 1), rank + rope_dim, torch.float8_e5m2)[0] for i in range(num_layers)]  # fmt: skip
    with pytest.raises(GeometryError, match="expected equal shapes"):
        grouped_mla_insert(kv_c, k_pe, mixed, slots, **kwargs)
    expected = _run_both(per_layer_mla_insert, kv_c, k_pe, mixed, slots, **kwargs)
    assert _same_bytes(mixed, expected)


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
def test_out_of_range_slots_are_skipped_or_rejected(kernel: Callable[..., None]) -> None:
    num_layers, num_tokens, rank, rope_dim, num_blocks, block_size = 2, 6, 8, 8, 2, 4
    kv_c, k_pe = _inputs(25, num_layers, num_tokens, rank, rope_dim, torch.float32)
    slots = torch.tensor([0, 8, 3, -1, 100, 7], device=DEVICE)  # capacity 8: 8 and 100 are out
    caches = _caches(26, num_layers, num_blocks, block_size, rank + rope_dim, torch.float32)
    before = [cache.clone() for cache in caches]
    with pytest.raises(InvalidBlockError, match=r"expected slots < 8.*got 100"):
        kernel(kv_c, k_pe, caches, slots, check_slots=True)
    assert _same_bytes(caches, before)  # nothing launched
    expected = _run_both(kernel, kv_c, k_pe, caches, slots)
    assert _same_bytes(caches, expected)
    assert not _same_bytes(caches, before)


class _Fenced:
    """A copy of ``t`` in the middle of a bigger buffer whose margins hold random bytes."""

    MARGIN_BYTES = 512  # each side; keeps the middle 16-byte aligned

    def __init__(self, t: torch.Tensor, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        nbytes = t.numel() * t.element_size()
        raw = torch.randint(0, 256, (nbytes + 2 * self.MARGIN_BYTES,), dtype=torch.uint8, generator=gen)  # fmt: skip
        self.raw = raw.to(t.device)
        self.margins = self._margins().clone()
        middle = self.raw[self.MARGIN_BYTES : self.MARGIN_BYTES + nbytes]
        self.t = middle.view(t.dtype).view(t.shape)
        self.t.copy_(t)

    def _margins(self) -> torch.Tensor:
        return torch.cat([self.raw[: self.MARGIN_BYTES], self.raw[-self.MARGIN_BYTES :]])

    def intact(self) -> bool:
        return torch.equal(self._margins(), self.margins)


@pytest.mark.parametrize("kernel", [*KERNELS.values(), "hook"], ids=[*KERNELS.keys(), "hook"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_out_of_range_slots_touch_nothing_around_any_tensor(
    kernel: Callable[..., None] | str, kv_cache_dtype: str
) -> None:
    # Every cache, input and the slot mapping sit inside poisoned margins; slots at and past the
    # capacity (and -1) must leave every margin byte as it was, and the caches equal the reference.
    num_layers, num_tokens, rank, rope_dim, num_blocks, block_size = 3, 13, 24, 8, 3, 4
    kv_c, k_pe = _inputs(41, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
    cache_dtype = FP8_DTYPES.get(kv_cache_dtype, torch.bfloat16)
    caches = _caches(42, num_layers, num_blocks, block_size, rank + rope_dim, cache_dtype)
    capacity = num_blocks * block_size
    slots = torch.tensor([[0, capacity, 3, -1, capacity + 1, 7, 2**40, 11, 1, 5, capacity * 4, 9, -7]] * num_layers)  # fmt: skip
    slots[1] = slots[1].roll(3)
    scales = None if kv_cache_dtype == "auto" else _scales(43, num_layers)
    kwargs = {"kv_cache_dtype": kv_cache_dtype, "kv_scales": scales}
    expected = _reference(kv_c, k_pe, caches, slots.to(DEVICE), **kwargs)
    fenced = [_Fenced(t, 50 + i) for i, t in enumerate([kv_c, k_pe, slots.to(DEVICE), *caches])]
    kv_f, pe_f, slots_f, *caches_f = (f.t for f in fenced)
    if kernel == "hook":
        hook = GroupedMLAInsertHook(caches_f, **kwargs)
        hook(StepContext(tensors={"kv_c": kv_f, "k_pe": pe_f, "slot_mapping": slots_f}))
    else:
        assert callable(kernel)
        kernel(kv_f, pe_f, caches_f, slots_f, **kwargs)
    assert all(f.intact() for f in fenced)
    assert _same_bytes(caches_f, expected)


def test_empty_step_writes_nothing() -> None:
    kv_c, k_pe = _inputs(27, 2, 0, 8, 8, torch.bfloat16)
    caches = _caches(28, 2, 2, 2, 16, torch.bfloat16)
    before = [cache.clone() for cache in caches]
    grouped_mla_insert(kv_c, k_pe, caches, torch.empty(0, dtype=torch.int64, device=DEVICE), check_slots=True)  # fmt: skip
    assert _same_bytes(caches, before)


def _bad_args(case: str) -> tuple[type[Exception], dict[str, object]]:
    """Arguments that break exactly one rule, and the error they must raise."""
    kv_c, k_pe = _inputs(29, 2, 5, 8, 8, torch.bfloat16)
    caches = _caches(30, 2, 2, 4, 16, torch.float8_e4m3fn)
    args: dict[str, object] = {
        "kv_c": kv_c, "k_pe": k_pe, "caches": caches, "slot_mapping": _slots(31, 5, 8, 1),
        "kv_cache_dtype": "fp8_e4m3", "kv_scales": _scales(32, 2),
    }  # fmt: skip
    error: type[Exception] = GeometryError
    if case == "unknown kv_cache_dtype":
        error, args["kv_cache_dtype"] = ConfigError, "fp8"
    elif case == "fp8 without scales":
        error, args["kv_scales"] = ConfigError, None
    elif case == "scales with auto":
        error, args["kv_cache_dtype"] = ConfigError, "auto"
    elif case == "int32 slots":
        args["slot_mapping"] = _slots(31, 5, 8, 1).to(torch.int32)
    elif case == "slots of wrong length":
        args["slot_mapping"] = _slots(31, 4, 8, 1)
    elif case == "k_pe token count":
        args["k_pe"] = k_pe[:, :4]
    elif case == "mixed input dtypes":
        args["k_pe"] = k_pe.half()
    elif case == "cache width":
        args["caches"] = _caches(30, 2, 2, 4, 15, torch.float8_e4m3fn)
    elif case == "cache dtype":
        args["caches"] = _caches(30, 2, 2, 4, 16, torch.float8_e5m2)
    elif case == "one cache per layer":
        args["caches"] = caches[:1]
    elif case == "scales shape":
        args["kv_scales"] = _scales(32, 3)
    elif case == "non-contiguous rows":
        args["kv_c"] = kv_c.transpose(1, 2).contiguous().transpose(1, 2)
    elif case == "misaligned cache":
        raw = torch.zeros(2 * 4 * 16 + 1, dtype=torch.uint8, device=DEVICE)
        args["caches"] = [caches[0], raw[1:].view(2, 4, 16)]
    return error, args


BAD_CASES = [
    "unknown kv_cache_dtype", "fp8 without scales", "scales with auto", "int32 slots",
    "slots of wrong length", "k_pe token count", "mixed input dtypes", "cache width",
    "cache dtype", "one cache per layer", "scales shape", "non-contiguous rows", "misaligned cache",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_CASES)
def test_validation_raises_typed_errors_before_writing(case: str) -> None:
    error, args = _bad_args(case)
    caches = args["caches"]
    assert isinstance(caches, list)
    before = [cache.clone() for cache in caches]
    with pytest.raises(error, match="expected"):
        grouped_mla_insert(**args)  # type: ignore[arg-type]
    assert _same_bytes(caches, before)
    if case != "misaligned cache":  # the per-layer path accepts any alignment
        with pytest.raises(error, match="expected"):
            per_layer_mla_insert(**args)  # type: ignore[arg-type]


STEP_CASES = [  # bad step tensors whose caches, dtype and scales are fine
    "int32 slots", "slots of wrong length", "k_pe token count", "mixed input dtypes",
    "scales shape", "non-contiguous rows", "slots of wrong layers", "float64 scales",
]  # fmt: skip


@pytest.mark.parametrize("case", STEP_CASES)
def test_a_bad_step_after_good_ones_raises_before_writing(case: str) -> None:
    # good steps first (new step tensors each, then the same ones again), so that the step
    # signature and the last call are remembered: a bad step of the same sizes must still
    # raise its typed error and leave every cache as it was, through the public function and
    # through a hook
    error, bad = _bad_args(case)
    if case == "slots of wrong layers":
        bad["slot_mapping"] = torch.stack([_slots(31, 5, 8, 1)] * 3)
    elif case == "float64 scales":
        bad["kv_scales"] = _scales(32, 2).double()
    good = _bad_args("good")[1]
    caches = bad["caches"]
    assert isinstance(caches, list)
    names = ("kv_c", "k_pe", "slot_mapping", "kv_scales")
    hook = GroupedMLAInsertHook(caches, kv_cache_dtype="fp8_e4m3", kv_scales=good["kv_scales"])  # type: ignore[arg-type]
    for step in range(4):
        fresh = {k: v.clone() if step < 3 else v for k, v in good.items() if k in names}
        grouped_mla_insert(fresh.pop("kv_c"), fresh.pop("k_pe"), caches, fresh.pop("slot_mapping"), kv_cache_dtype="fp8_e4m3", **fresh)  # type: ignore[arg-type]  # fmt: skip
        hook(StepContext(tensors={k: good[k].clone() if step < 3 else good[k] for k in names[:3]}))  # fmt: skip
    before = [cache.clone() for cache in caches]
    with pytest.raises(error, match="expected"):
        grouped_mla_insert(**bad)  # type: ignore[arg-type]
    if case not in ("scales shape", "float64 scales"):  # the hook's scales are its own
        with pytest.raises(error, match="expected"):
            hook(StepContext(tensors={k: bad[k] for k in names[:3]}))
    assert _same_bytes(caches, before)


@pytest.mark.parametrize("case", STEP_CASES)
def test_a_bad_step_after_a_guarded_signature_raises_before_writing(case: str) -> None:
    # a signature found on consecutive calls gets torch's C++ guard: later steps that pass it
    # skip the signature's reads. A bad step with the same scales object must fail the guard
    # (or, for bad scales, the scales identity) and raise its typed error before writing.
    error, bad = _bad_args(case)
    if case == "slots of wrong layers":
        bad["slot_mapping"] = torch.stack([_slots(31, 5, 8, 1)] * 3)
    good = _bad_args("good")[1]
    if case == "float64 scales":
        bad["kv_scales"] = _scales(32, 2).double()
    elif case != "scales shape":
        bad["kv_scales"] = good["kv_scales"]
    caches = bad["caches"]
    assert isinstance(caches, list)
    api._MEMO.clear()
    for _ in range(4):  # new step tensors, one scales object
        grouped_mla_insert(good["kv_c"].clone(), good["k_pe"].clone(), caches,  # type: ignore[union-attr]
                           good["slot_mapping"].clone(), kv_cache_dtype="fp8_e4m3", kv_scales=good["kv_scales"])  # type: ignore[union-attr, arg-type]  # fmt: skip
    assert api._MEMO.steady_record(id(caches)) is not None  # the one-guard path is armed
    before = [cache.clone() for cache in caches]
    with pytest.raises(error, match="expected"):
        grouped_mla_insert(**bad)  # type: ignore[arg-type]
    assert _same_bytes(caches, before)


def _steady_steps(good: dict[str, object], caches: list[torch.Tensor], hooks: Sequence[GroupedMLAInsertHook]) -> None:  # fmt: skip
    """Five steps of new step tensors (clones of ``good``) through the public function and each
    hook, each checked against the reference: a steady loop. Asserts that the fast paths are
    then armed (the memo's one guard of caches and step, each hook's step guard)."""
    names = ("kv_c", "k_pe", "slot_mapping")
    for _ in range(5):
        step = {k: good[k].clone() for k in (*names, "kv_scales")}  # type: ignore[union-attr]
        expected = _reference(*(step[k] for k in names[:2]), caches, step["slot_mapping"],
                              kv_cache_dtype="fp8_e4m3", kv_scales=step["kv_scales"])  # fmt: skip
        grouped_mla_insert(step["kv_c"], step["k_pe"], caches, step["slot_mapping"], kv_cache_dtype="fp8_e4m3", kv_scales=step["kv_scales"])  # fmt: skip
        assert _same_bytes(caches, expected)
        for hook in hooks:
            hook(StepContext(tensors={k: good[k].clone() for k in names}))  # type: ignore[union-attr]
    assert id(caches) in api._MEMO._steady
    assert all(hook._insert.guarded is not None and hook._insert.fired is not None for hook in hooks if not hook._check_slots)  # fmt: skip


META_CASES = ["kv_c on the meta device", "k_pe on the meta device", "slot_mapping on the meta device", "kv_scales on the meta device"]  # fmt: skip
STEADY_CASES = [*STEP_CASES, "slot past the capacity", "kv_c on the CPU", *META_CASES]


@pytest.mark.parametrize("case", STEADY_CASES)
def test_a_bad_step_after_steady_steps_is_refused_as_on_a_first_call(case: str) -> None:
    # a steady loop (one cache list, new step tensors of one signature) runs the public function
    # on ONE C++ guard of caches and step (InsertMemo.launch_steady) and the hook on its step
    # guard. A new step tensor of another dtype, shape, stride, layer count or device, or (with
    # check_slots) a slot past the capacity, must still raise the typed error of a first call,
    # through both, and write nothing; the poison of every cache stays
    if case == "kv_c on the CPU" and DEVICE == "cpu":
        pytest.skip("needs a CUDA GPU (one device here)")
    error, bad = _bad_args("good" if case in ("slot past the capacity", "kv_c on the CPU", *META_CASES) else case)  # fmt: skip
    good = _bad_args("good")[1]
    if case == "slots of wrong layers":
        bad["slot_mapping"] = torch.stack([_slots(31, 5, 8, 1)] * 3)
    elif case == "float64 scales":
        bad["kv_scales"] = _scales(32, 2).double()
    elif case == "slot past the capacity":
        error, bad["check_slots"] = InvalidBlockError, True
        bad["slot_mapping"] = good["slot_mapping"].clone()  # type: ignore[union-attr]
        bad["slot_mapping"][2] = 8  # capacity: 2 blocks x 4
    elif case == "kv_c on the CPU":
        bad["kv_c"] = good["kv_c"].cpu()  # type: ignore[union-attr]
    elif case in META_CASES:  # storage-less, device index -1 as on the CPU: must not pass as it
        name = case.split()[0]
        bad[name] = torch.empty_like(good[name], device="meta")  # type: ignore[arg-type]
    caches = bad["caches"]
    assert isinstance(caches, list)
    api._MEMO.clear()
    checked = case == "slot past the capacity"
    hook = GroupedMLAInsertHook(caches, kv_cache_dtype="fp8_e4m3", kv_scales=good["kv_scales"], check_slots=checked)  # type: ignore[arg-type]  # fmt: skip
    _steady_steps(good, caches, [hook])
    before = [cache.clone() for cache in caches]
    with pytest.raises(error, match="expected"):
        grouped_mla_insert(**bad)  # type: ignore[arg-type]
    if "scales" not in case:  # the hook's scales are its own
        with pytest.raises(error, match="expected"):
            hook(StepContext(tensors={k: bad[k] for k in ("kv_c", "k_pe", "slot_mapping")}))
    assert _same_bytes(caches, before)
    _steady_steps(good, caches, [hook])  # and the loop goes on exactly


def test_persistent_step_buffers_run_on_one_guard_and_stay_exact() -> None:
    # the very same step tensors every call (persistent buffers; bench mla-insert's "grouped",
    # one list per cache set) get the memo's one guard of caches and step too: the buffers'
    # contents may change between calls, a cache given new storage in place is written there,
    # a buffer re-strided in place (same pointer and shape) is read as it is now, and a bad step
    # after the loop raises its typed error before writing
    good = _bad_args("good")[1]
    caches = good["caches"]
    assert isinstance(caches, list)
    api._MEMO.clear()
    args = {**good}
    for turn in range(5):
        args["kv_c"].mul_(-1.5)  # type: ignore[union-attr]  # new contents, the same tensor
        expected = _reference(args["kv_c"], args["k_pe"], caches, args["slot_mapping"], kv_cache_dtype="fp8_e4m3", kv_scales=args["kv_scales"])  # type: ignore[arg-type]  # fmt: skip
        grouped_mla_insert(**args)  # type: ignore[arg-type]
        assert _same_bytes(caches, expected), turn
    assert api._MEMO.steady_record(id(caches)) is not None
    caches[1].set_(_caches(33, 1, 2, 4, 16, torch.float8_e4m3fn)[0])  # new storage in place
    expected = _reference(args["kv_c"], args["k_pe"], caches, args["slot_mapping"], kv_cache_dtype="fp8_e4m3", kv_scales=args["kv_scales"])  # type: ignore[arg-type]  # fmt: skip
    grouped_mla_insert(**args)  # type: ignore[arg-type]
    assert _same_bytes(caches, expected)
    kv_c = args["kv_c"]
    assert isinstance(kv_c, torch.Tensor)
    num_layers, _, rank = kv_c.shape  # the same object, its rows re-strided in place:
    kv_c.as_strided_(kv_c.shape, (rank, num_layers * rank, 1))  # same pointer, another layout
    expected = _reference(kv_c, args["k_pe"], caches, args["slot_mapping"], kv_cache_dtype="fp8_e4m3", kv_scales=args["kv_scales"])  # type: ignore[arg-type]  # fmt: skip
    grouped_mla_insert(**args)  # type: ignore[arg-type]
    assert _same_bytes(caches, expected)
    before = [cache.clone() for cache in caches]
    with pytest.raises(GeometryError, match="expected"):
        grouped_mla_insert(**{**args, "k_pe": args["k_pe"].half()})  # type: ignore[arg-type, union-attr]
    assert _same_bytes(caches, before)


def test_caches_on_the_meta_device_are_refused_as_another_device() -> None:
    # meta tensors have no storage and get_device() -1, as CPU tensors (the interpreted kernels'
    # memory): the public function and the hook must refuse meta caches with the typed error
    good = _bad_args("good")[1]
    meta_caches = [torch.empty_like(cache, device="meta") for cache in good["caches"]]  # type: ignore[attr-defined]
    api._MEMO.clear()
    with pytest.raises(GeometryError, match="expected cuda"):
        grouped_mla_insert(**{**good, "caches": meta_caches})  # type: ignore[arg-type]
    with pytest.raises(GeometryError, match="expected cuda"):
        per_layer_mla_insert(**{**good, "caches": meta_caches})  # type: ignore[arg-type]
    with pytest.raises(GeometryError, match="expected cuda"):
        GroupedMLAInsertHook(meta_caches, kv_cache_dtype="fp8_e4m3", kv_scales=good["kv_scales"])  # type: ignore[arg-type]  # fmt: skip
    assert api._MEMO.num_sets == 0


def test_steady_steps_of_other_valid_layouts_are_written_exactly() -> None:
    # between the steps of a steady loop, steps of the same sizes but other strides, another
    # base alignment, the other slot layout or another T are valid: each must leave the
    # one-guard path for its own launch, and be written exactly; other scales of the same
    # layout stay on it (their pointer is read every step)
    good = _bad_args("good")[1]
    caches = good["caches"]
    assert isinstance(caches, list)
    api._MEMO.clear()
    kv_c, k_pe, slots, scales = (good[k] for k in ("kv_c", "k_pe", "slot_mapping", "kv_scales"))
    for case in ("token-strided kv_c", "k_pe 2 bytes past alignment", "other scales", "[L, T] slots", "T = 3", "a stride-0 expand"):  # fmt: skip
        _steady_steps(good, caches, [])
        step = {"kv_c": kv_c.clone(), "k_pe": k_pe.clone(), "slot_mapping": slots.clone(), "kv_scales": scales}  # type: ignore[union-attr]  # fmt: skip
        if case == "token-strided kv_c":
            step["kv_c"] = torch.cat([kv_c, kv_c], dim=-1)[..., :8]  # type: ignore[list-item]
        elif case == "k_pe 2 bytes past alignment":
            storage = torch.empty(k_pe.numel() + 1, dtype=k_pe.dtype, device=DEVICE)  # type: ignore[union-attr]
            step["k_pe"] = storage[1:].view(k_pe.shape).copy_(k_pe)  # type: ignore[union-attr]
        elif case == "other scales":
            step["kv_scales"] = _scales(33, 2)
        elif case == "[L, T] slots":
            step["slot_mapping"] = torch.stack([slots, slots.roll(1)])  # type: ignore[union-attr]
        elif case == "T = 3":
            step = {k: v[..., :3, :] if k in ("kv_c", "k_pe") else v[:3] if k == "slot_mapping" else v for k, v in step.items()}  # type: ignore[index]  # fmt: skip
        else:
            step["slot_mapping"] = slots.clone().expand(2, 5)  # type: ignore[union-attr]
        expected = _reference(step["kv_c"], step["k_pe"], caches, step["slot_mapping"], kv_cache_dtype="fp8_e4m3", kv_scales=step["kv_scales"])  # fmt: skip
        took = api._MEMO.launch_steady(
            api._MEMO.steady_record(id(caches)), caches, "fp8_e4m3", True, **step
        )  # type: ignore[arg-type]
        assert (took is not None) is (case == "other scales"), case  # its pointer is read per step
        if took is None:
            grouped_mla_insert(step["kv_c"], step["k_pe"], caches, step["slot_mapping"], kv_cache_dtype="fp8_e4m3", kv_scales=step["kv_scales"])  # fmt: skip
        assert _same_bytes(caches, expected), case


def test_a_guarded_signature_writes_exactly_what_each_step_holds() -> None:
    # a steady loop (new step tensors of one signature) runs on the guard; steps of the same
    # shape but other strides, another base alignment, the other slot layout, another T or other
    # scales must leave it for their own signature, and every step must be exact
    num_layers, rank, rope_dim, num_blocks, block_size = 3, 24, 8, 6, 4
    caches = _caches(340, num_layers, num_blocks, block_size, rank + rope_dim, torch.float8_e4m3fn)
    scales, others = _scales(341, num_layers), _scales(342, num_layers)
    insert = _insert(caches, "fp8_e4m3")
    guarded = 0
    for step in range(16):
        num_tokens = 3 if step == 11 else 5
        kv_c, k_pe = _inputs(343 + step, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
        slots, step_scales = _slots(370 + step, num_tokens, num_blocks * block_size, 1), scales
        if step == 5:  # a base 2 bytes past 16-byte alignment
            storage = torch.empty(k_pe.numel() + 1, dtype=k_pe.dtype, device=DEVICE)
            k_pe = storage[1:].view(k_pe.shape).copy_(k_pe)
        elif step == 7:  # the same shape, token-strided rows of a wider tensor
            kv_c = torch.cat([kv_c, kv_c], dim=-1)[..., :rank]
        elif step == 9:
            slots = torch.stack([slots.roll(i) for i in range(num_layers)])
        elif step == 13:
            step_scales = others
        expected = _reference(kv_c, k_pe, caches, slots, kv_cache_dtype="fp8_e4m3", kv_scales=step_scales)  # fmt: skip
        assert insert(kv_c, k_pe, slots, step_scales) == num_tokens
        guarded += insert.fired is not None
        assert _same_bytes(caches, expected), step
        assert insert._last[6].args[-1] is (step != 5)  # IO_ALIGNED: off for that base
    assert guarded >= 6


def test_remembered_step_signatures_write_exactly_what_each_step_holds() -> None:
    # new step tensors of sizes seen before take the remembered signature (no checks, no key):
    # every step must still be exact, also when a step of the same shape has other strides (a
    # slice of wider rows), another base alignment or the other slot layout, and T = 1 steps
    # whose size-1 dims carry odd strides
    num_layers, rank, rope_dim, num_blocks, block_size = 3, 24, 8, 6, 4
    caches = _caches(190, num_layers, num_blocks, block_size, rank + rope_dim, torch.float8_e4m3fn)
    scales = _scales(191, num_layers)
    insert = _insert(caches, "fp8_e4m3")
    assert insert._plain  # the grouped kernel's runtime arguments are all do_not_specialize
    for step in range(12):
        num_tokens = (5, 1)[step % 2]
        kv_c, k_pe = _inputs(192 + step, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
        slots = _slots(210 + step, num_tokens, num_blocks * block_size, step % 3 == 0)
        if step % 4 == 1:  # the same shape, token-strided rows of a wider tensor
            wide = torch.cat([kv_c, kv_c], dim=-1)
            kv_c = wide[..., :rank]
        elif step % 4 == 2:  # a base 2 bytes past 16-byte alignment
            storage = torch.empty(k_pe.numel() + 1, dtype=k_pe.dtype, device=DEVICE)
            k_pe = storage[1:].view(k_pe.shape).copy_(k_pe)
        elif step % 4 == 3:
            slots = torch.stack([slots.roll(i) for i in range(num_layers)])
        if num_tokens == 1 and step % 3 == 1:  # contiguous, with an odd stride on the T dim
            kv_c = kv_c.as_strided(kv_c.shape, (rank, 7, 1))
        expected = _reference(kv_c, k_pe, caches, slots, kv_cache_dtype="fp8_e4m3", kv_scales=scales)  # fmt: skip
        assert insert(kv_c.clone() if step > 9 else kv_c, k_pe, slots, scales) == num_tokens
        assert _same_bytes(caches, expected)
        assert insert._last[6].args[-1] is (step % 4 != 2)  # IO_ALIGNED: off for that base
    assert 4 <= len(insert._steps) <= 12


def test_rotating_scales_tensors_each_write_with_their_own_scales_and_layout() -> None:
    # the scales' key part (shape, stride, device) is remembered per scales object (16 kept):
    # a loop alternating among more of them, some strided views (another STRIDE_SCALE), must
    # write each step with that step's scales, never another object's layout
    num_layers, rank, rope_dim, num_blocks, block_size = 3, 24, 8, 6, 4
    caches = _caches(230, num_layers, num_blocks, block_size, rank + rope_dim, torch.float8_e4m3fn)
    insert = _insert(caches, "fp8_e4m3")
    objects = []
    for i in range(18):
        scales = _scales(231 + i, num_layers)
        if i % 3 == 2:  # a strided view over every second float
            scales = torch.stack([scales, _scales(260 + i, num_layers)], dim=1)[:, 0]
        objects.append(scales)
    kv_c, k_pe = _inputs(280, num_layers, 5, rank, rope_dim, torch.bfloat16)
    for step, scales in enumerate([*objects, *objects[:4], objects[17], objects[2]]):
        slots = _slots(300 + step, 5, num_blocks * block_size, 1)
        expected = _reference(kv_c, k_pe, caches, slots, kv_cache_dtype="fp8_e4m3", kv_scales=scales)  # fmt: skip
        assert insert(kv_c, k_pe, slots, scales) == 5
        assert _same_bytes(caches, expected), step
    assert len(insert._scales_keys) <= 16  # some steps pass the guard: no key part read


def test_hook_inserts_from_step_context() -> None:
    num_layers, num_tokens, rank, rope_dim = 2, 10, 16, 8
    kv_c, k_pe = _inputs(33, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
    slots, scales = _slots(34, num_tokens, 12, 2), _scales(35, num_layers)
    caches = _caches(36, num_layers, 3, 4, rank + rope_dim, torch.float8_e4m3fn)
    expected = _reference(kv_c, k_pe, caches, slots, kv_cache_dtype="fp8_e4m3", kv_scales=scales)
    hook = GroupedMLAInsertHook(caches, kv_cache_dtype="fp8_e4m3", kv_scales=scales)
    assert isinstance(hook, StepHook) and hook.is_grouped
    ctx = StepContext(tensors={"kv_c": kv_c, "k_pe": k_pe, "slot_mapping": slots})
    report = hook(ctx)
    assert (report.name, report.launches, report.extra["num_tokens"]) == ("mla_insert", 1, 10)
    assert _same_bytes(caches, expected)
    with pytest.raises(ConfigError, match="missing \\['k_pe'\\]"):
        hook(StepContext(tensors={"kv_c": kv_c, "slot_mapping": slots}))


def test_hook_falls_back_to_per_layer_and_validates_at_construction() -> None:
    num_layers, num_tokens, rank, rope_dim = 3, 7, 8, 8
    kv_c, k_pe = _inputs(37, num_layers, num_tokens, rank, rope_dim, torch.float16)
    slots = _slots(38, num_tokens, 8, 1)
    caches = [_caches(39 + i, 1, 2 + i, 4, rank + rope_dim, torch.float16)[0] for i in range(num_layers)]  # fmt: skip
    expected = _reference(kv_c, k_pe, caches, slots)
    hook = GroupedMLAInsertHook(caches, name="insert")
    assert not hook.is_grouped
    report = hook(StepContext(tensors={"kv_c": kv_c, "k_pe": k_pe, "slot_mapping": slots}))
    assert (report.name, report.launches) == ("insert", num_layers)
    assert _same_bytes(caches, expected)
    with pytest.raises(ConfigError, match="expected float32"):
        GroupedMLAInsertHook(caches, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(GeometryError, match="expected"):
        GroupedMLAInsertHook([caches[0], caches[1].float()])


@pytest.mark.parametrize(("block_tokens", "num_warps"), [(2, None), (8, 4), (16, 2)])
def test_tile_overrides_cover_tails(block_tokens: int, num_warps: int | None) -> None:
    # T = 19 is not a multiple of any tile: the last tile is partial in every layer.
    num_layers, num_tokens, rank, rope_dim = 2, 19, 24, 8
    kv_c, k_pe = _inputs(45, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
    slots = _slots(46, num_tokens, 24, 3)
    for kernel in KERNELS.values():
        caches = _caches(47, num_layers, 6, 4, rank + rope_dim, torch.float8_e4m3fn)
        kwargs = {"kv_cache_dtype": "fp8_e4m3", "kv_scales": _scales(48, num_layers)}
        expected = _reference(kv_c, k_pe, caches, slots, **kwargs)
        kernel(kv_c, k_pe, caches, slots, block_tokens=block_tokens, num_warps=num_warps, **kwargs)
        assert _same_bytes(caches, expected)
    with pytest.raises(ConfigError, match="expected a power of two"):
        grouped_mla_insert(kv_c, k_pe, caches, slots, block_tokens=3, **kwargs)


def test_tile_heuristic_follows_the_h200_sweep() -> None:
    # T x L rows -> (tokens per program, warps); 2 warps up to 4-token tiles (see launch_config).
    launch_config = plan.launch_config
    assert launch_config(5 * 16384, None, None) == (4, 2)  # 78% of the HBM peak on the H200
    assert launch_config(5 * 4096, None, None) == (2, 2)
    assert launch_config(5 * 512, None, None) == (1, 2)
    assert launch_config(5 * 16384, 8, None) == (8, 4)
    assert launch_config(5 * 16384, 16, None) == (16, 8)
    assert launch_config(7, None, 4) == (1, 4)


def _insert(caches: Sequence[torch.Tensor], kv_cache_dtype: str) -> GroupedInsert:
    return GroupedInsert(plan.make_plan(plan.checked_key(caches, kv_cache_dtype)))


def test_packed_path_checks_and_binds_once_per_step_signature_for_one_compiled_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Steps of any T (same tile) share one signature per slot layout ([T] or [L, T]): bound
    # once each, then only pointers, T, layer strides and the grid change; every step exact.
    # Both signatures are one specialization of the kernel (its runtime arguments are all
    # do_not_specialize), so one compiled kernel serves every step: the classes of each bound
    # launch's arguments are read with the rule over a JITFunction twin of the kernel (under the
    # interpreter the kernel itself is never compiled).
    num_layers, rank, rope_dim, num_blocks, block_size = 3, 24, 8, 6, 4
    caches = _caches(150, num_layers, num_blocks, block_size, rank + rope_dim, torch.float8_e4m3fn)
    scales = _scales(151, num_layers)
    insert = _insert(caches, "fp8_e4m3")
    specializations = set()
    kernel = mla_kernel.grouped_insert_kernel
    if not isinstance(kernel, JITFunction):  # the interpreter's InterpretedFunction
        kernel = JITFunction(kernel.fn, do_not_specialize=mla_kernel.GROUPED_RUNTIME_ARGS)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kinds = rule.param_kinds(kernel)
    assert kinds is not None
    for step, num_tokens in enumerate([5, 1, 16, 11, 2, 7]):
        kv_c, k_pe = _inputs(152 + step, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
        slots = _slots(160 + step, num_tokens, num_blocks * block_size, num_tokens // 4)
        if step % 2:
            slots = torch.stack([slots.roll(i) for i in range(num_layers)])
        expected = _reference(
            kv_c, k_pe, caches, slots, kv_cache_dtype="fp8_e4m3", kv_scales=scales
        )
        assert insert(kv_c, k_pe, slots, scales) == num_tokens
        assert _same_bytes(caches, expected)
        specializations |= {rule.reader(kinds)(*b.args)[0] for b in insert.bound()}
    assert insert.num_bound == 2 and len(specializations) == 1
    bound = insert._last[6]  # the last step's launch: its arguments are that step's
    assert bound.args[0] is kv_c and bound.args[1] is k_pe and bound.args[3] is slots
    assert bound.args[5:9] == [7, kv_c.stride(0), k_pe.stride(0), slots.stride(0)]
    assert bound.is_packed is (DEVICE == "cuda")  # packed on a GPU; the interpreter: Triton
    with pytest.raises(GeometryError, match="slot_mapping"):  # T disagrees: the checks run
        insert(kv_c, k_pe, slots[:, :3], scales)


def test_the_same_step_tensors_again_only_relaunch() -> None:
    # persistent step buffers: the second call with the very same tensors skips the signature
    # and writes again what the buffers hold now
    num_layers, rank, rope_dim, num_blocks, block_size = 2, 24, 8, 6, 4
    caches = _caches(156, num_layers, num_blocks, block_size, rank + rope_dim, torch.bfloat16)
    insert = _insert(caches, "auto")
    kv_c, k_pe = _inputs(157, num_layers, 9, rank, rope_dim, torch.bfloat16)
    slots = _slots(158, 9, num_blocks * block_size, 2)
    for seed in (159, 160):
        kv_c.copy_(_inputs(seed, num_layers, 9, rank, rope_dim, torch.bfloat16)[0])
        expected = _reference(kv_c, k_pe, caches, slots)
        assert insert(kv_c, k_pe, slots, None) == 9
        assert _same_bytes(caches, expected) and insert.num_bound == 1


@pytest.mark.parametrize("check", ["guard", "reads"])
@pytest.mark.parametrize(
    "change",
    ["set_", "resize_", "as_strided_", "restrided, same shape", ".data = a view", "new list, same tensors"],
)  # fmt: skip
def test_repeated_caches_are_recognised_and_in_place_changes_are_seen(
    change: str, check: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # grouped_mla_insert remembers its cache sets by what a plan is made of (shape, strides,
    # dtype, device, pointers); a cache swapped for new storage, resized or restrided in place
    # between two calls must be planned again, never written through the old plan's pointer
    # table or geometry. A new list holding the same caches is the same set. Both checks of a
    # known list: torch's C++ tensor guard plus the pointers, and the attribute reads (a torch
    # without the guard).
    api._MEMO.clear()
    if check == "reads":
        monkeypatch.setattr(_tensor_guard, "_TensorGuards", None)
    num_layers, rank, rope_dim, num_blocks, block_size = 3, 24, 8, 6, 4
    width = rank + rope_dim
    caches = _caches(170, num_layers, num_blocks, block_size, width, torch.bfloat16)
    for step in range(5):  # new step tensors of one signature: from the third on, a steady loop
        kv_c, k_pe = _inputs(171 + step, num_layers, 7, rank, rope_dim, torch.bfloat16)
        slots = _slots(173 + step, 7, num_blocks * block_size, 2)
        expected = _run_both(grouped_mla_insert, kv_c, k_pe, caches, slots)
        assert _same_bytes(caches, expected)
    remembered = api._MEMO.insert_for(caches, "auto", True)
    assert remembered.num_bound == 1  # the calls went through one insert
    assert (api._MEMO._lists[id(caches)][8] is None) is (check == "reads")
    # with the guard, the next step of that signature would take the one-guard path
    assert (id(caches) in api._MEMO._steady) is (check == "guard")
    fresh = _caches(175, 1, num_blocks, block_size, width, torch.bfloat16)[0]
    if change == "set_":
        caches[1].set_(fresh)  # same shape, new storage: a new pointer
    elif change == "resize_":  # a smaller capacity, same pointers
        for cache in caches:
            cache.resize_(num_blocks - 2, block_size, width)
    elif change == "as_strided_":  # blocks 0 and 2 as a 2-block cache: a doubled block stride
        for cache in caches:
            cache.as_strided_((2, block_size, width), (block_size * width * 2, width, 1))
    elif change == "restrided, same shape":  # token-major blocks: no longer contiguous
        for cache in caches:
            cache.as_strided_(cache.shape, (width, num_blocks * width, 1))
    elif change == ".data = a view":  # the first blocks of the same storage, no version bump
        for cache in caches:
            cache.data = cache.data[: num_blocks - 3]
    else:
        caches = list(caches)
    is_same_set = change == "new list, same tensors"
    capacity = min(c.shape[0] * c.shape[1] for c in caches)
    kv_c, k_pe = _inputs(176, num_layers, 7, rank, rope_dim, torch.bfloat16)  # the same signature
    if check == "guard" and not is_same_set:  # the steady path must refuse the changed caches
        assert api._MEMO.launch_steady(api._MEMO.steady_record(id(caches)), caches, "auto", True, kv_c, k_pe, _slots(177, 7, capacity, 2), None) is None  # fmt: skip
    assert (api._MEMO.insert_for(caches, "auto", True) is remembered) is is_same_set
    slots = _slots(177, 7, capacity, 2)
    expected = _run_both(grouped_mla_insert, kv_c, k_pe, caches, slots)
    assert _same_bytes(caches, expected)
    if change in ("set_", "new list, same tensors"):
        assert _same_bytes([fresh] if change == "set_" else caches[1:2], expected[1:2])


def test_the_caches_memo_sees_a_dtype_change_and_keeps_no_cache_alive() -> None:
    # found by a fresh-user pass: ``.data =`` of another dtype kept pointer, shape and strides,
    # and the memo held the last cache set for the life of the process
    import gc
    import weakref

    num_layers, rank, rope_dim, num_blocks, block_size = 2, 24, 8, 6, 4
    caches = _caches(180, num_layers, num_blocks, block_size, rank + rope_dim, torch.bfloat16)
    for step in range(5):  # new step tensors: from the third on, the one-guard path
        kv_c, k_pe = _inputs(181 + step, num_layers, 5, rank, rope_dim, torch.bfloat16)
        grouped_mla_insert(kv_c, k_pe, caches, _slots(184 + step, 5, num_blocks * block_size, 1))
    assert id(caches) in api._MEMO._steady
    remembered = api._MEMO.insert_for(caches, "auto", True)
    for cache in caches:
        cache.data = cache.view(torch.float16)
    assert api._MEMO.insert_for(caches, "auto", True) is not remembered
    with pytest.raises(GeometryError):  # as without the memo: bf16 rows into float16 caches
        grouped_mla_insert(kv_c, k_pe, caches, _slots(190, 5, num_blocks * block_size, 1))
    probe = weakref.ref(caches[0])
    del caches, cache
    gc.collect()
    assert probe() is None


def test_a_known_cache_set_is_recognised_across_grad_modes() -> None:
    # the C++ guard compares dispatch keys under the mode it was built in: a set remembered
    # outside inference mode and used inside it (a serving loop's warm-up, then its steps) is the
    # same set, found by the attribute reads once, then by a guard built for the new mode
    num_layers, rank, rope_dim, num_blocks, block_size = 2, 24, 8, 6, 4
    caches = _caches(320, num_layers, num_blocks, block_size, rank + rope_dim, torch.bfloat16)
    kv_c, k_pe = _inputs(321, num_layers, 5, rank, rope_dim, torch.bfloat16)
    api._MEMO.clear()
    expected = _run_both(grouped_mla_insert, kv_c, k_pe, caches, _slots(322, 5, 24, 1))
    remembered = api._MEMO.insert_for(caches, "auto", True)
    first_guard = api._MEMO._lists[id(caches)][8]
    assert first_guard is not None and _same_bytes(caches, expected)
    for step in range(3):
        with torch.inference_mode():
            assert api._MEMO.insert_for(caches, "auto", True) is remembered
            slots = _slots(323 + step, 5, 24, 1)
            expected = _reference(kv_c, k_pe, caches, slots)
            grouped_mla_insert(kv_c, k_pe, caches, slots)
        assert _same_bytes(caches, expected)
    guard = api._MEMO._lists[id(caches)][8]
    assert guard is not first_guard and guard is not None  # rebuilt once, under inference mode
    with torch.inference_mode():
        for cache in caches:  # a change is still seen
            cache.resize_(num_blocks - 1, block_size, rank + rope_dim)
        assert api._MEMO.insert_for(caches, "auto", True) is not remembered


def test_misaligned_inputs_are_copied_without_alignment_hints() -> None:
    # kv_c starting one element into its storage: IO_ALIGNED must be off (a wrong hint would
    # fault or corrupt on the GPU); the result must still be exact.
    num_layers, num_tokens, rank, rope_dim, num_blocks, block_size = 2, 7, 16, 8, 4, 4
    kv_c, k_pe = _inputs(140, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
    storage = torch.empty(kv_c.numel() + 1, dtype=kv_c.dtype, device=DEVICE)
    shifted = storage[1:].view(kv_c.shape)
    shifted.copy_(kv_c)
    assert shifted.data_ptr() % 16 != 0
    caches = _caches(141, num_layers, num_blocks, block_size, rank + rope_dim, torch.bfloat16)
    slots = _slots(142, num_tokens, num_blocks * block_size, 2)
    expected = _run_both(grouped_mla_insert, shifted, k_pe, caches, slots)
    assert _same_bytes(caches, expected)
    # IO_ALIGNED (the last constexpr) is set for the aligned copy only.
    expected = _run_both(grouped_mla_insert, kv_c, k_pe, caches, slots)
    assert _same_bytes(caches, expected)
    insert = api._MEMO.insert_for(caches, "auto", True)
    assert sorted(bound.args[-1] for bound in insert.bound()) == [False, True]


def _cuda_memo(monkeypatch: pytest.MonkeyPatch, capturing: list[bool], max_sets: int) -> memo.InsertMemo:  # fmt: skip
    """A memo that takes CPU caches for caches on cuda:0 (plans still built on the CPU) and sees
    a capturing stream while ``capturing[0]``."""
    key_of, make = memo.cache_key, memo.make_plan
    monkeypatch.setattr(memo, "cache_key", lambda *a: (lambda k: (k[0], 0, *k[2:]))(key_of(*a)))
    monkeypatch.setattr(memo, "make_plan", lambda key: make((key[0], -1, *key[2:])))
    monkeypatch.setattr(memo, "_is_capturing", lambda: capturing[0])
    return memo.InsertMemo(max_sets=max_sets)


@pytest.mark.parametrize("capturing", [False, True])
def test_a_cache_set_used_under_capture_outlives_the_recent_sets(
    monkeypatch: pytest.MonkeyPatch, capturing: bool
) -> None:
    # A graph replays its pointer table long after capture: the insert (its plan, its table)
    # looked up while the stream captures must survive newer cache sets pushing it out of the
    # recent ones; one never used under capture is dropped. CPU caches stand in for cuda:0.
    state = [False]
    memo_ = _cuda_memo(monkeypatch, state, max_sets=2)
    caches = _caches(200, 3, 5, 4, 20, torch.float16)
    first = memo_.insert_for(caches, "auto", True)  # eager: builds the table
    state[0] = capturing
    assert memo_.insert_for(caches, "auto", True) is first
    state[0] = False
    table_before = first.plan.table.clone()
    newer = [_caches(seed, 3, 5, 4, 20, torch.float16) for seed in (201, 202)]
    for others in newer:  # two newer sets: the first leaves the recent ones
        memo_.insert_for(others, "auto", True)
    again = memo_.insert_for(caches, "auto", True)
    assert (again is first) is capturing
    assert torch.equal(first.plan.table, table_before)
    assert first.plan.table.tolist() == [cache.data_ptr() for cache in caches]


def test_a_first_call_under_capture_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    caches = _caches(203, 2, 3, 4, 20, torch.float16)
    key = plan.checked_key(caches, "auto")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ConfigError, match="before CUDA-graph capture"):
        plan.make_plan((key[0], 0, *key[2:]))


def test_hook_reports_are_ordinary_frozen_reports() -> None:
    # the hooks build their reports with HookReport.of (the per-step path): the same value as
    # the keyword constructor's, frozen, evolvable
    import attrs

    from kvmgr.hooks import HookReport

    caches = _caches(159, 2, 3, 4, 32, torch.bfloat16)
    kv_c, k_pe = _inputs(158, 2, 5, 24, 8, torch.bfloat16)
    report = GroupedMLAInsertHook(caches)(StepContext(tensors={"kv_c": kv_c, "k_pe": k_pe, "slot_mapping": _slots(157, 5, 12, 1)}))  # fmt: skip
    expected = HookReport(name="mla_insert", launches=1, host_s=report.host_s, extra={"num_tokens": 5, "grouped": True})  # fmt: skip
    assert report == expected and report.host_s > 0 and type(report) is HookReport
    assert HookReport.of("x", 2, 1, 0.5, {"a": 1}) == HookReport(name="x", launches=2, skips=1, host_s=0.5, extra={"a": 1})  # fmt: skip
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        report.launches = 3  # type: ignore[misc]
    assert attrs.evolve(report, skips=1).skips == 1


def test_hook_without_per_step_checks_inserts_the_same() -> None:
    num_layers, num_tokens, rank, rope_dim = 2, 9, 16, 8
    kv_c, k_pe = _inputs(150, num_layers, num_tokens, rank, rope_dim, torch.float16)
    slots, scales = _slots(151, num_tokens, 12, 2), _scales(152, num_layers)
    caches = _caches(153, num_layers, 3, 4, rank + rope_dim, torch.uint8)
    kwargs = {"kv_cache_dtype": "fp8_e5m2", "kv_scales": scales}
    expected = _reference(kv_c, k_pe, caches, slots, **kwargs)
    checked = GroupedMLAInsertHook(caches, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(GeometryError, match="expected"):  # a step of the wrong width
        checked(StepContext(tensors={"kv_c": kv_c, "k_pe": k_pe[..., :4], "slot_mapping": slots}))  # fmt: skip
    hook = GroupedMLAInsertHook(caches, validate=False, **kwargs)  # type: ignore[arg-type]
    report = hook(StepContext(tensors={"kv_c": kv_c, "k_pe": k_pe, "slot_mapping": slots}))
    assert report.launches == 1 and _same_bytes(caches, expected)
    # Triton's normal launch (direct_launch=False) writes the same bytes over fresh poison
    normal = _caches(154, num_layers, 3, 4, rank + rope_dim, torch.uint8)
    expected = [cache.clone() for cache in normal]
    mla_insert_reference(kv_c, k_pe, expected, slots, **kwargs)  # type: ignore[arg-type]
    hook = GroupedMLAInsertHook(normal, direct_launch=False, **kwargs)  # type: ignore[arg-type]
    hook(StepContext(tensors={"kv_c": kv_c, "k_pe": k_pe, "slot_mapping": slots}))
    assert _same_bytes(normal, expected) and not _same_bytes(normal, _caches(154, num_layers, 3, 4, rank + rope_dim, torch.uint8))  # fmt: skip


# ---------------------------------------------------------------- GPU (skipped without CUDA)


def _kernels_match_reference(
    seed: int,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slots: torch.Tensor,
    num_blocks: int,
    block_size: int,
    kv_cache_dtype: str,
) -> None:
    """Each of ``KERNELS`` on the GPU, into caches of random bytes (``[num_blocks, block_size,
    R + P]`` per layer; scales from ``seed``, poison from ``seed + 1``), writes the reference's
    bytes."""
    num_layers, width = kv_c.shape[0], kv_c.shape[-1] + k_pe.shape[-1]
    scales = None if kv_cache_dtype == "auto" else _scales(seed, num_layers)
    kwargs = {"kv_cache_dtype": kv_cache_dtype, "kv_scales": scales}
    cache_dtype = FP8_DTYPES.get(kv_cache_dtype, torch.bfloat16)
    for kernel in KERNELS.values():
        caches = _caches(seed + 1, num_layers, num_blocks, block_size, width, cache_dtype)
        expected = _run_both(kernel, kv_c, k_pe, caches, slots, **kwargs)
        torch.cuda.synchronize()
        assert _same_bytes(caches, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("num_layers", [5, 61])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_gpu_deepseek_geometry(num_layers: int, block_size: int, kv_cache_dtype: str) -> None:
    # R = kv_lora_rank 512, P = qk_rope_head_dim 64; T irregular; [L, T] slots for L = 5.
    rank, rope_dim, num_tokens = 512, 64, 1237
    num_blocks = (2 * num_tokens) // block_size + 3
    kv_c, k_pe = _inputs(50, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
    if num_layers == 5:
        slots = torch.stack([_slots(51 + i, num_tokens, num_blocks * block_size, 100) for i in range(num_layers)])  # fmt: skip
    else:
        slots = _slots(51, num_tokens, num_blocks * block_size, 100)
    _kernels_match_reference(60, kv_c, k_pe, slots, num_blocks, block_size, kv_cache_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_gpu_large_step_uses_big_tiles(kv_cache_dtype: str) -> None:
    # 16391 tokens x 5 layers picks 4-token tiles, with a partial last tile.
    num_tokens, block_size = 16391, 64
    num_blocks = num_tokens // block_size + 9
    kv_c, k_pe = _inputs(62, 5, num_tokens, 512, 64, torch.bfloat16)  # L = 5, R = 512, P = 64
    slots = _slots(63, num_tokens, num_blocks * block_size, 37)
    _kernels_match_reference(64, kv_c, k_pe, slots, num_blocks, block_size, kv_cache_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_gpu_direct_launch_is_exact_across_step_sizes_and_layouts(kv_cache_dtype: str) -> None:
    # The grouped path launches Triton's CompiledKernel directly, memoized per launch spec: one
    # compile must serve every T, and a misaligned or strided step must get its own exact kernel.
    num_layers, rank, rope_dim, num_blocks, block_size = 5, 512, 64, 160, 16
    width, capacity = rank + rope_dim, num_blocks * block_size
    cache_dtype = FP8_DTYPES.get(kv_cache_dtype, torch.bfloat16)
    caches = _caches(160, num_layers, num_blocks, block_size, width, cache_dtype)
    kwargs = {"kv_cache_dtype": kv_cache_dtype, "kv_scales": None}
    if kv_cache_dtype != "auto":
        kwargs["kv_scales"] = _scales(161, num_layers)
    for step, num_tokens in enumerate([1, 2, 17, 300, 1237, 2]):
        kv_c, k_pe = _inputs(162 + step, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
        if step == 2:  # kv_c one element into its storage: no alignment hint
            storage = torch.empty(kv_c.numel() + 1, dtype=kv_c.dtype, device=DEVICE)
            kv_c = storage[1:].view(kv_c.shape).copy_(kv_c)
        if step == 5:  # slices of one fused projection, padded rows
            fused = torch.cat([kv_c, torch.ones_like(k_pe[..., :8]), k_pe], dim=-1)
            kv_c, k_pe = fused[..., :rank], fused[..., rank + 8 :]
        slots = _slots(170 + step, num_tokens, capacity, num_tokens // 5)
        if step % 2:  # [L, T] on odd steps
            slots = torch.stack([slots.roll(i) for i in range(num_layers)])
        expected = _run_both(grouped_mla_insert, kv_c, k_pe, caches, slots, **kwargs)
        torch.cuda.synchronize()
        assert _same_bytes(caches, expected), f"step {step}, T = {num_tokens}"
    launcher = shared_launcher(mla_kernel.grouped_insert_kernel)
    assert launcher.direct and launcher.num_compiled >= 3  # aligned, misaligned, fused: 3 keys
    insert = api._MEMO.insert_for(caches, kv_cache_dtype, True)
    assert all(bound.is_packed for bound in insert.bound())


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_gpu_direct_and_normal_launches_write_the_same_bytes(kv_cache_dtype: str) -> None:
    # The opt-out (Triton's normal launch) and the default direct launch: same kernel, same bytes.
    num_layers, num_tokens, rank, rope_dim, num_blocks, block_size = 5, 300, 512, 64, 32, 16
    kv_c, k_pe = _inputs(190, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
    slots = _slots(191, num_tokens, num_blocks * block_size, 30)
    kwargs = {"kv_cache_dtype": kv_cache_dtype, "kv_scales": None}
    if kv_cache_dtype != "auto":
        kwargs["kv_scales"] = _scales(192, num_layers)
    cache_dtype = FP8_DTYPES.get(kv_cache_dtype, torch.bfloat16)
    results = []
    for direct_launch in (True, False, True):
        caches = _caches(193, num_layers, num_blocks, block_size, rank + rope_dim, cache_dtype)
        insert = functools.partial(grouped_mla_insert, direct_launch=direct_launch)
        expected = _run_both(insert, kv_c, k_pe, caches, slots, **kwargs)
        torch.cuda.synchronize()
        assert _same_bytes(caches, expected)
        results.append(caches)
    assert _same_bytes(results[0], results[1]) and _same_bytes(results[1], results[2])
    assert shared_launcher(mla_kernel.grouped_insert_kernel).direct


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["grouped", "per_layer", "hook"])
def test_gpu_cuda_graph_capture_and_replay(variant: str) -> None:
    num_layers, num_tokens, rank, rope_dim, num_blocks, block_size = 5, 300, 512, 64, 40, 16
    width = rank + rope_dim
    # Forget tables of earlier tests: freed caches' addresses may come back for `fresh` below.
    api._MEMO.clear()
    # Static buffers the graph reads; each replay gets new contents.
    kv_c, k_pe = _inputs(70, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
    slots = _slots(71, num_tokens, num_blocks * block_size, 20)
    scales = _scales(72, num_layers)
    caches = _caches(73, num_layers, num_blocks, block_size, width, torch.float8_e4m3fn)
    kwargs = {"kv_cache_dtype": "fp8_e4m3", "kv_scales": scales}
    hook = GroupedMLAInsertHook(caches, **kwargs)  # type: ignore[arg-type]
    tensors = {"kv_c": kv_c, "k_pe": k_pe, "slot_mapping": slots}

    def step(capturing: bool = False) -> None:
        if variant == "hook":
            assert hook(StepContext(tensors=tensors, is_capturing=capturing)).launches == 1
        else:
            KERNELS[variant](kv_c, k_pe, caches, slots, **kwargs)

    # Warm up (compile, build the pointer table) on a side stream, as torch recommends.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    fresh = _caches(74, num_layers, num_blocks, block_size, width, torch.float8_e4m3fn)
    with torch.cuda.graph(graph):
        with pytest.raises(ConfigError, match="capture"):  # reads device data on the host
            grouped_mla_insert(kv_c, k_pe, caches, slots, check_slots=True, **kwargs)
        with pytest.raises(ConfigError, match="before CUDA-graph capture"):  # no table yet
            grouped_mla_insert(kv_c, k_pe, fresh, slots, **kwargs)
        step(capturing=True)
    for replay in range(3):
        new_kv_c, new_k_pe = _inputs(80 + replay, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)  # fmt: skip
        kv_c.copy_(new_kv_c)
        k_pe.copy_(new_k_pe)
        slots.copy_(_slots(90 + replay, num_tokens, num_blocks * block_size, 20 + replay))
        scales.copy_(_scales(95 + replay, num_layers))
        poison = _caches(
            100 + replay, num_layers, num_blocks, block_size, width, torch.float8_e4m3fn
        )
        for cache, fill in zip(caches, poison, strict=True):
            cache.view(torch.uint8).copy_(fill.view(torch.uint8))
        expected = _reference(kv_c, k_pe, caches, slots, **kwargs)
        graph.replay()
        torch.cuda.synchronize()
        assert _same_bytes(caches, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("steady", [False, True])
def test_gpu_graph_outlives_the_eager_plan_memo(steady: bool) -> None:
    # A graph captured through grouped_mla_insert reads its pointer table at every replay. The
    # eager memo drops the table after 32 newer cache sets; the capture must keep it alive.
    # steady: eager calls on the default stream (no capture query there) arm the list's steady
    # record, the capture goes through it, and 32 newer records push it out too.
    num_layers, num_tokens, rank, rope_dim, num_blocks, block_size = 3, 40, 512, 64, 8, 16
    width, capacity = rank + rope_dim, num_blocks * block_size
    api._MEMO.clear()
    kv_c, k_pe = _inputs(210, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
    slots = _slots(211, num_tokens, capacity, 4)
    caches = _caches(212, num_layers, num_blocks, block_size, width, torch.bfloat16)
    # 1. Eager call (compile, table) on a side stream, then capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        grouped_mla_insert(kv_c, k_pe, caches, slots)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3 if steady else 0):  # the default stream: handle 0
        grouped_mla_insert(kv_c, k_pe, caches, slots)
    assert (api._MEMO.steady_record(id(caches)) is not None) is steady
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_mla_insert(kv_c, k_pe, caches, slots)
    # 2. 32 newer cache sets push these out of the memo's recent ones and its records (three
    #    calls each: a list seen before gets a record; the capture itself made one for `caches`
    #    in both cases, so the graph must outlive that record too).
    newer = [_caches(300 + seed, num_layers, 1, block_size, width, torch.bfloat16) for seed in range(32)]  # fmt: skip
    one = (kv_c[:, :1], k_pe[:, :1], slots[:1] % block_size)
    for others in newer:
        for _ in range(3):
            grouped_mla_insert(one[0], one[1], others, one[2])
    assert api._MEMO.steady_record(id(caches)) is None
    # 3. Tables pointing at a decoy cache take any freed table memory on the same stream, so a
    #    freed table would send the replay's writes to the decoy instead of faulting.
    decoy = _caches(213, 1, num_blocks, block_size, width, torch.bfloat16)[0]
    decoy_before = decoy.clone()
    with torch.cuda.stream(side):
        decoy_tables = [
            torch.full((num_layers,), decoy.data_ptr(), dtype=torch.int64, device=DEVICE)
            for _ in range(512)
        ]
    torch.cuda.synchronize()
    # 4. Replay with new inputs: the real caches get the rows, the decoy stays as it was.
    new_kv_c, new_k_pe = _inputs(214, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
    kv_c.copy_(new_kv_c)
    k_pe.copy_(new_k_pe)
    expected = _reference(kv_c, k_pe, caches, slots)
    graph.replay()
    torch.cuda.synchronize()
    assert _same_bytes(caches, expected)
    assert torch.equal(decoy.view(torch.uint8), decoy_before.view(torch.uint8))
    del decoy_tables
    api._MEMO.clear()


@pytest.mark.gpu
def test_gpu_hook_runs_on_the_given_stream() -> None:
    num_layers, num_tokens, rank, rope_dim = 5, 64, 512, 64
    kv_c, k_pe = _inputs(110, num_layers, num_tokens, rank, rope_dim, torch.bfloat16)
    slots = _slots(111, num_tokens, 128, 4)
    caches = _caches(112, num_layers, 8, 16, rank + rope_dim, torch.bfloat16)
    expected = _reference(kv_c, k_pe, caches, slots)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    hook = GroupedMLAInsertHook(caches)
    hook(StepContext(tensors={"kv_c": kv_c, "k_pe": k_pe, "slot_mapping": slots}, stream=stream))
    stream.synchronize()
    assert _same_bytes(caches, expected)


def test_hook_module_imports_without_triton() -> None:
    # kvmgr may re-export the hook: importing it must not pull in Triton.
    code = "import sys, kvmgr.kernels.mla.hook; sys.exit('triton' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_without_cuda_fails_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_bench_args("--tokens", "1,16")) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "mla.json"
    args = _bench_args("--tokens", "1,300", "--reps", "3", "--rotate-mib", "8", "--json", str(out))
    assert bench.run(args) == 0
    result = json.loads(out.read_text())
    assert result["hbm_copy_peak_gbps"] > 100
    assert len(result["rows"]) == 2 * 2 * 2  # kv dtypes x token counts x modes
    assert all(row["grouped_us"] > 0 and row["per_layer_us"] > 0 for row in result["rows"])
    hosts = ("per_layer_host_us", "grouped_host_us", "grouped_triton_host_us", "grouped_same_host_us",
             "hook_host_us", "hook_triton_host_us", "hook_unchecked_host_us")  # fmt: skip
    for row in result["rows"]:  # host timings for eager rows only
        assert all((row[key] is None) == (row["mode"] == "graph") for key in hosts)


_STUB_STEADY = """
import json, os, struct, sys
import torch

sys.path.insert(0, os.getcwd())
from kvmgr.bench import stub_gpu
seen = stub_gpu.install(record=True)
from kvmgr.errors import ConfigError, GeometryError
from kvmgr.hooks import StepContext
from kvmgr.kernels.mla.api import _MEMO, grouped_mla_insert
from kvmgr.kernels.mla.hook import GroupedMLAInsertHook

gen = torch.Generator().manual_seed(5)
caches = [torch.zeros(4, 16, 96, dtype=torch.float8_e4m3fn) for _ in range(3)]
scales = torch.rand(3, generator=gen) + 0.5
hook = GroupedMLAInsertHook(caches, kv_cache_dtype="fp8_e4m3", kv_scales=scales)
rows, armed = [], []

def cells(call):  # the step's pointer cells and ints as the driver saw them
    p = call["params"]
    return [struct.unpack_from("<Q", p[i])[0] for i in (0, 1, 2, 3, 4)] + [struct.unpack_from("<i", p[i])[0] for i in (5, 6, 7, 8)]

def step(num_tokens, via, table):
    kv_c = torch.randn(3, num_tokens, 64, generator=gen)
    k_pe = torch.randn(3, num_tokens, 32, generator=gen)
    slots = torch.randperm(64, generator=gen)[:num_tokens]
    before = len(seen.calls)
    if via == "public":
        grouped_mla_insert(kv_c, k_pe, caches, slots, kv_cache_dtype="fp8_e4m3", kv_scales=scales)
    else:
        hook(StepContext(tensors={"kv_c": kv_c, "k_pe": k_pe, "slot_mapping": slots}))
    want = [kv_c.data_ptr(), k_pe.data_ptr(), table().data_ptr(), slots.data_ptr(), scales.data_ptr(), num_tokens, kv_c.stride(0), k_pe.stride(0), 0]
    rows.append([len(seen.calls) - before, cells(seen.calls[-1]) == want])

public_table = lambda: _MEMO.insert_for(caches, "fp8_e4m3", True).plan.table
for via, table in (("public", public_table), ("hook", lambda: hook.plan.table)):
    for num_tokens in (5, 5, 5, 5, 7, 5, 5, 7, 7, 5, 5, 5):  # T = 7 rewrites the launch's ints
        step(num_tokens, via, table)
    record = _MEMO.steady_record(id(caches))
    armed.append(record is not None and record[7] is not None if via == "public" else hook._insert.guarded[5] is not None)
armed.append(_MEMO.steady_record(id(caches))[4][2][2][0])  # the record's guarded T: 5
for cache in caches:  # new storage in place: the steady record's pointers no longer match
    cache.set_(torch.zeros(4, 16, 96, dtype=torch.float8_e4m3fn))
for _ in range(4):
    step(5, "public", public_table)
# persistent step buffers and their own cache set (bench mla-insert's "grouped"): the same
# tensors every call get a record too; a buffer given new storage in place is launched with it
own = [torch.zeros(4, 16, 96, dtype=torch.float8_e4m3fn) for _ in range(3)]
kv_c, k_pe, slots = torch.randn(3, 5, 64, generator=gen), torch.randn(3, 5, 32, generator=gen), torch.arange(5)
for turn in range(6):
    if turn == 4:
        kv_c.data = torch.randn(3, 5, 64, generator=gen)
    before = len(seen.calls)
    grouped_mla_insert(kv_c, k_pe, own, slots, kv_cache_dtype="fp8_e4m3", kv_scales=scales)
    want = [kv_c.data_ptr(), k_pe.data_ptr(), _MEMO.insert_for(own, "fp8_e4m3", True).plan.table.data_ptr(), slots.data_ptr(), scales.data_ptr(), 5, 320, 160, 0]
    rows.append([len(seen.calls) - before, cells(seen.calls[-1]) == want])
record = _MEMO.steady_record(id(own))
armed.append(record is not None and record[7] is not None)
# another list of the same caches (one insert, no record yet): its tensors again after the
# record launched others take the insert's identity shortcut only while its cells hold them
alias, mine = list(own), [(torch.randn(3, 5, 64, generator=gen), torch.randn(3, 5, 32, generator=gen), torch.arange(5) + 8 * i) for i in range(2)]
for tensors, cache_list in ((mine[0], alias), (mine[1], own), (mine[0], alias)):
    before = len(seen.calls)
    grouped_mla_insert(*tensors[:2], cache_list, tensors[2], kv_cache_dtype="fp8_e4m3", kv_scales=scales)
    want = [tensors[0].data_ptr(), tensors[1].data_ptr(), _MEMO.insert_for(own, "fp8_e4m3", True).plan.table.data_ptr(), tensors[2].data_ptr(), scales.data_ptr(), 5, 320, 160, 0]
    rows.append([len(seen.calls) - before, cells(seen.calls[-1]) == want])
# a record's launch under capture holds its insert (the graph replays its table); the query is
# skipped on the legacy default stream (handle 0): CPU caches stand in for a GPU's
from kvmgr.kernels.mla import memo
for _ in range(2):  # the alias's calls re-guarded the insert: its record is rebuilt
    grouped_mla_insert(kv_c, k_pe, own, slots, kv_cache_dtype="fp8_e4m3", kv_scales=scales)
asked, key = [], _MEMO.steady_record(id(own))[3]
memo._is_capturing = lambda: asked.append(1) or True
_MEMO._steady[id(own)] = _MEMO.steady_record(id(own))[:9] + (True,)
streams = torch._C._cuda_getCurrentRawStream.__self__  # the stub's {device: handle}
for handle in (0, 7):
    streams[0] = handle
    grouped_mla_insert(kv_c, k_pe, own, slots, kv_cache_dtype="fp8_e4m3", kv_scales=scales)
    armed.append([len(asked), key in _MEMO._held])
plain = [torch.zeros(4, 16, 96) for _ in range(3)]  # auto caches: a record without scales
for _ in range(4):
    grouped_mla_insert(torch.randn(3, 5, 64, generator=gen), torch.randn(3, 5, 32, generator=gen), plain, torch.arange(5))
armed.append(_MEMO.steady_record(id(plain))[7] is not None)
before = len(seen.calls)
refused = []
for bad in ("dtype", "meta", "no scales", "scales for auto"):
    kv_c = torch.randn(3, 5, 64, generator=gen)
    kv_c = kv_c.half() if bad == "dtype" else torch.empty_like(kv_c, device="meta") if bad == "meta" else kv_c
    many = (plain, None) if bad == "scales for auto" else (caches, "fp8_e4m3")
    try:
        grouped_mla_insert(kv_c, torch.randn(3, 5, 32), many[0], torch.arange(5), kv_cache_dtype=many[1] or "auto", kv_scales=None if bad == "no scales" else scales)
    except (ConfigError, GeometryError):
        refused.append(bad)
print(json.dumps({"rows": rows, "armed": armed, "refused": refused, "launched": len(seen.calls) - before}))
"""


def test_steady_steps_through_the_c_cell_writer_launch_each_steps_arguments(tmp_path: Path) -> None:
    # the public function's steady record and the hook's guarded signature write the step's
    # pointers and ints into the packed launch's cells from C (kvmgr.kernels.mla.steady): on
    # the stand-in GPU every launch must hold exactly its step's pointers, T and strides, also
    # after a step of another T rewrote the shared launch's ints; caches given new storage in
    # place are not launched through the record's stale pointers; a record's launch leaves the
    # insert no last tensors for its identity shortcut (another list of the same caches); bad
    # steps still raise, scales missing for FP8 or given for auto too (a record of either kind);
    # under capture the record's insert is held (asked after the launch, not on stream 0)
    if torch.cuda.is_available():
        pytest.skip("the gpu tests launch for real")
    from kvmgr.kernels.launch.cells import cell_writer

    if cell_writer() is None:
        pytest.skip("the C module cannot be built here (no C compiler?)")
    script = tmp_path / "stub_steady.py"
    script.write_text(_STUB_STEADY)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["armed"] == [True, True, 5, True, [0, False], [1, True], True]
    assert result["rows"] == [[1, True]] * 37
    assert result["refused"] == ["dtype", "meta", "no scales", "scales for auto"]
    assert result["launched"] == 0
