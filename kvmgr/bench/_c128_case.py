"""The cases of ``kvmgr bench c128``: one layer and one step, and the boundary-step check
(private to ``kvmgr.bench.c128``).

Offers:
    Case                  a layer's caches and a step's tensors (random), the hook over them,
                          the two launchers and their reference arguments
    decode_case           a decode step of a batch, request 0 at a compression boundary or not
    check_boundary_step   one boundary step through the launchers and a packed-launch hook,
                          compared with the torch reference
    D, STATE_BLOCK        head dimension, state-cache block size
"""

from __future__ import annotations

import numpy as np
import torch

from kvmgr.hooks import StepContext
from kvmgr.kernels.c128.api import c128_compress, c128_entry_bytes, c128_state_write
from kvmgr.kernels.c128.hook import C128CompressorHook
from kvmgr.kernels.c128.reference import c128_compress_ref, c128_unpack, rope_cos_sin_cache

__all__ = ["STATE_BLOCK", "Case", "D", "check_boundary_step", "decode_case"]

D = 512
STATE_BLOCK = 8


class Case:
    """One layer and one step on ``device``: ``starts[r]`` computed tokens, ``qlens[r]`` new
    ones; random caches, tensors and block tables."""

    def __init__(
        self, gen: torch.Generator, starts: list[int], qlens: list[int], device: str
    ) -> None:
        width = max(s + q for s, q in zip(starts, qlens, strict=True)) // STATE_BLOCK + 1
        num_reqs, num_tokens = len(starts), sum(qlens)
        table = torch.randperm(num_reqs * width, generator=gen).view(num_reqs, width)
        pos = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, qlens, strict=True)])
        req = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(qlens))
        state_slots = table[req, pos // STATE_BLOCK] * STATE_BLOCK + pos % STATE_BLOCK
        comp_blocks = num_tokens // 64 + 1
        layer = {
            "state_cache": torch.randn(num_reqs * width, STATE_BLOCK, 2 * D, generator=gen),
            "compressed_cache": torch.randint(
                0, 256, (comp_blocks, 64, c128_entry_bytes(D)), generator=gen, dtype=torch.uint8
            ),
            "ape": torch.randn(128, D, generator=gen),
            "norm_weight": 0.5 + torch.rand(D, generator=gen),
            "cos_sin_cache": rope_cos_sin_cache(int(pos.max()) + 1),
        }
        tensors = {
            "positions": pos,
            "c128.state_slot_mapping": state_slots.to(torch.int32),
            "c128.state_block_table": table.to(torch.int32),
            "c128.req_indices": req.to(torch.int32),
            "c128.slot_mapping": torch.randperm(comp_blocks * 64, generator=gen)[:num_tokens],
            "c128.kv": torch.randn(num_tokens, D, generator=gen).bfloat16(),
            "c128.score": (3 * torch.randn(num_tokens, D, generator=gen)).bfloat16(),
        }
        self.layer = {k: v.to(device) for k, v in layer.items()}
        self.tensors = {k: v.to(device) for k, v in tensors.items()}
        self.starts = np.array(starts, dtype=np.int64)
        self.query_start_loc = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int64)

    def context(self) -> StepContext:
        return StepContext(num_computed_tokens=self.starts, query_start_loc=self.query_start_loc,
                           tensors=self.tensors)  # fmt: skip

    def hook(self, *, gated: bool, direct: bool = False) -> C128CompressorHook:
        lay = self.layer
        return C128CompressorHook(
            state_cache=lay["state_cache"], compressed_cache=lay["compressed_cache"],
            ape=lay["ape"], norm_weight=lay["norm_weight"], cos_sin_cache=lay["cos_sin_cache"],
            gated=gated, direct_launch=direct,
        )  # fmt: skip

    def write(self) -> None:
        t = self.tensors
        c128_state_write(t["c128.kv"], t["c128.score"], self.layer["ape"], t["positions"],
                         t["c128.state_slot_mapping"], self.layer["state_cache"])  # fmt: skip

    def compress(self) -> None:
        c128_compress(*self.compress_args(self.layer["compressed_cache"]))

    def write_and_compress(self) -> None:
        self.write()
        self.compress()

    def compress_args(self, compressed_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t, lay = self.tensors, self.layer
        return (lay["state_cache"], t["c128.state_block_table"], t["c128.req_indices"],
                t["positions"], t["c128.slot_mapping"], lay["norm_weight"],
                lay["cos_sin_cache"], compressed_cache)  # fmt: skip


def _decode_starts(rng: np.random.Generator, batch: int, *, boundary: bool) -> list[int]:
    """Positions of a decode step (one token per request); only request 0 may be at a boundary."""
    if batch == 1:
        return [127 if boundary else 126]
    pos = rng.integers(0, 512, batch)
    pos = np.where((pos + 1) % 128 == 0, pos - 1, pos)
    if boundary:
        pos[0] = pos[0] // 128 * 128 + 127
    return [int(p) for p in pos]


def decode_case(
    gen: torch.Generator, rng: np.random.Generator, batch: int, boundary: bool, device: str
) -> Case:
    """A decode step of ``batch`` requests (one token each); request 0 at a boundary or not."""
    return Case(gen, _decode_starts(rng, batch, boundary=boundary), [1] * batch, device)


def check_boundary_step(
    gen: torch.Generator, rng: np.random.Generator, batch: int, device: str
) -> bool:
    """One boundary step through the launchers, then through a packed-launch hook, vs the
    reference.

    The hook runs twice from the same poisoned caches: its first call binds (compiles), the
    second relaunches the bound launch, and that second result is compared.
    """
    case = decode_case(gen, rng, batch, True, device)
    state, comp = case.layer["state_cache"], case.layer["compressed_cache"]
    state_poison, comp_poison = state.clone(), comp.clone()
    expected = comp.clone()
    case.write()
    c128_compress_ref(*case.compress_args(expected))
    case.compress()
    pos, slots = case.tensors["positions"], case.tensors["c128.slot_mapping"].long()
    slots = slots[(pos + 1) % 128 == 0]
    ok = _entries_match(comp, expected, slots)
    hook = case.hook(gated=True, direct=True)
    for _ in range(2):
        state.copy_(state_poison)
        comp.copy_(comp_poison)
        hook(case.context())
    return ok and _entries_match(comp, expected, slots)


def _entries_match(out: torch.Tensor, ref: torch.Tensor, slots: torch.Tensor) -> bool:
    """Boundary slots match within FP8/bf16 rounding (scales exactly); all others are unchanged."""
    got, want = (t.view(-1, c128_entry_bytes(D)) for t in (out, ref))
    untouched = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
    untouched[slots] = False
    nope, rope, exps = c128_unpack(got[slots])
    nope_ref, rope_ref, exps_ref = c128_unpack(want[slots])
    return bool(
        slots.numel() > 0
        and torch.equal(got[untouched], want[untouched])
        and torch.equal(exps, exps_ref)
        and torch.allclose(nope, nope_ref, rtol=0.13, atol=1e-3)
        and torch.allclose(rope, rope_ref, rtol=2**-7, atol=1e-6)
    )
