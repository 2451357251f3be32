"""c128 compressor: the host gate, both kernels against their torch references, and the hook.

Kernels run under the Triton interpreter on CPU (``conftest.py`` routes its FP8 conversion
through torch) and natively on the GPU (``gpu`` tests, larger shapes and CUDA-graph capture).
Every cache starts filled with random bytes/values that stand for earlier steps; whatever a
kernel must not touch is compared against that poison exactly.
"""

from __future__ import annotations

import math
import re
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmgr.errors import GeometryError, InvalidBlockError
from kvmgr.hooks import StepContext, StepHook
from kvmgr.kernels.c128.api import (
    c128_boundary,
    c128_compress,
    c128_entry_bytes,
    c128_state_write,
)
from kvmgr.kernels.c128.hook import C128CompressorHook
from kvmgr.kernels.c128.reference import (
    c128_compress_ref,
    c128_state_write_ref,
    c128_unpack,
    rope_cos_sin_cache,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# --- scenario ------------------------------------------------------------------------------


class Step:
    """One scheduler step of several requests over random, scattered state blocks.

    ``reqs`` lists ``(num_computed_tokens, num_new_tokens)``. State blocks of a request are a
    random permutation, so a window spans non-adjacent blocks. Every token (boundary or not)
    gets a distinct compressed slot; ``num_pad`` padding tokens at boundary positions carry
    slot -1 in both mappings and are spread through the batch.
    """

    def __init__(self, seed, reqs, *, head_dim=512, block_size=8, num_pad=0,
                 dtype=torch.bfloat16, table_width=None):  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        self.reqs, self.head_dim, self.block_size = reqs, head_dim, block_size
        width = table_width or max(math.ceil((s + q) / block_size) for s, q in reqs) + 1
        num_blocks = width * len(reqs) + 5
        self.state_block_table = torch.randperm(num_blocks, generator=gen)[: width * len(reqs)]
        self.state_block_table = self.state_block_table.view(len(reqs), width).to(torch.int32)
        self.state_cache = torch.randn(num_blocks, block_size, 2 * head_dim, generator=gen)
        positions, req_indices = [], []
        for r, (start, qlen) in enumerate(reqs):
            positions += range(start, start + qlen)
            req_indices += [r] * qlen
        pos, req = torch.tensor(positions), torch.tensor(req_indices, dtype=torch.int32)
        state_slots = self.state_block_table[req.long(), pos // block_size].long() * block_size
        state_slots += pos % block_size
        pad_at = torch.randint(0, len(positions) + 1, (num_pad,), generator=gen).sort().values
        for i, at in enumerate(pad_at.tolist()):  # padding tokens sit at boundary positions
            at += i
            pos = torch.cat([pos[:at], torch.tensor([127 + 128 * i]), pos[at:]])
            req = torch.cat([req[:at], torch.tensor([0], dtype=torch.int32), req[at:]])
            state_slots = torch.cat([state_slots[:at], torch.tensor([-1]), state_slots[at:]])
        num_tokens = pos.shape[0]
        entry_bytes = c128_entry_bytes(head_dim)
        self.compressed_cache = torch.randint(
            0, 256, (num_tokens // 4 + 2, 4, entry_bytes), generator=gen, dtype=torch.uint8
        )
        self.slot_mapping = torch.randperm(num_tokens + 3, generator=gen)[:num_tokens]
        self.slot_mapping[state_slots < 0] = -1
        self.positions, self.req_indices = pos, req
        self.state_slot_mapping = state_slots.to(torch.int32)
        self.kv = torch.randn(num_tokens, head_dim, generator=gen).to(dtype)
        self.score = (3 * torch.randn(num_tokens, head_dim, generator=gen)).to(dtype)
        self.ape = torch.randn(128, head_dim, generator=gen)
        self.norm_weight = 0.5 + torch.rand(head_dim, generator=gen)
        self.cos_sin_cache = rope_cos_sin_cache(max(s + q for s, q in reqs) + 128 * num_pad + 1)
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(DEV))

    def boundary_slots(self) -> torch.Tensor:
        """Compressed slots the step must write."""
        hit = ((self.positions + 1) % 128 == 0) & (self.slot_mapping >= 0)
        return self.slot_mapping[hit]

    def write_args(self, state_cache):
        return (self.kv, self.score, self.ape, self.positions, self.state_slot_mapping, state_cache)

    def compress_args(self, state_cache, compressed_cache):
        return (state_cache, self.state_block_table, self.req_indices, self.positions,
                self.slot_mapping, self.norm_weight, self.cos_sin_cache, compressed_cache)  # fmt: skip

    def context(self, name="c128", **kw) -> StepContext:
        starts = np.array([s for s, _ in self.reqs])
        loc = np.concatenate([[0], np.cumsum([q for _, q in self.reqs])])
        tensors = {"positions": self.positions, "c128.state_slot_mapping": self.state_slot_mapping,
                   "c128.state_block_table": self.state_block_table,
                   "c128.req_indices": self.req_indices, "c128.slot_mapping": self.slot_mapping,
                   f"{name}.kv": self.kv, f"{name}.score": self.score}  # fmt: skip
        kw = {"num_computed_tokens": starts, "query_start_loc": loc, **kw}
        return StepContext(tensors=tensors, **kw)


def run_kernels(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    state, comp = step.state_cache.clone(), step.compressed_cache.clone()
    c128_state_write(*step.write_args(state))
    c128_compress(*step.compress_args(state, comp))
    return state, comp


def run_refs(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    state, comp = step.state_cache.clone(), step.compressed_cache.clone()
    c128_state_write_ref(*step.write_args(state))
    c128_compress_ref(*step.compress_args(state, comp))
    return state, comp


def assert_entries_match(out: torch.Tensor, ref: torch.Tensor, poison: torch.Tensor, slots):
    """Written slots: scales exact, NoPE within one FP8 step, RoPE within one bf16 step.

    Every other slot keeps its poison byte for byte.
    """
    entry_bytes = out.shape[-1]
    out, ref, poison = (t.view(-1, entry_bytes).cpu() for t in (out, ref, poison))
    slots = slots.long().cpu()
    untouched = torch.ones(out.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(out[untouched], poison[untouched])
    assert slots.numel() > 0
    got, want = out[slots], ref[slots]
    nope, rope, exps = c128_unpack(got)
    nope_ref, rope_ref, exps_ref = c128_unpack(want)
    assert torch.equal(exps, exps_ref)
    assert torch.equal(got[:, -1], torch.zeros_like(got[:, -1]))  # the pad byte
    scale = torch.exp2(exps.double()).float().repeat_interleave(64, dim=-1)
    assert ((nope - nope_ref).abs() <= nope_ref.abs() / 8 + scale * 2**-9).all()
    nope_bytes = nope.shape[-1]
    assert (got[:, :nope_bytes] == want[:, :nope_bytes]).float().mean() >= 0.99
    assert ((rope - rope_ref).abs() <= rope_ref.abs() * 2**-7 * 1.001).all()
    assert rope.abs().min() > 0 and nope.abs().max() > 0  # real data, not zeros


# --- gate ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("starts", "loc", "expected"),
    [
        ([0], [0, 127], False),
        ([0], [0, 128], True),
        ([127], [0, 1], True),
        ([128], [0, 127], False),
        ([1, 255], [0, 1, 2], True),
        ([5, 126, 300], [0, 7, 8, 40], False),
        ([], [0], False),
    ],
)
def test_gate_table(starts, loc, expected):
    assert c128_boundary(np.array(starts, dtype=np.int64), np.array(loc)) is expected


def test_gate_unknown_counts_give_none():
    assert c128_boundary(None, np.array([0, 1])) is None
    assert c128_boundary(np.array([127]), None) is None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 400)), max_size=80),
    st.sampled_from(["int32", "int64", "uint32", "torch", "list"]),
)
def test_gate_matches_brute_force(reqs, kind):
    # up to 32 requests the gate scans Python ints, above that it uses numpy; inputs that are
    # not int32/int64 numpy arrays take the converting path: every path gives the same answer
    starts = np.array([s for s, _ in reqs], dtype=np.int64)
    loc = np.concatenate([[0], np.cumsum([q for _, q in reqs])]).astype(np.int64)
    convert = {"int32": lambda a: a.astype(np.int32), "int64": lambda a: a,
               "uint32": lambda a: a.astype(np.uint32), "torch": torch.from_numpy,
               "list": lambda a: a.tolist()}[kind]  # fmt: skip
    brute = any((p + 1) % 128 == 0 for s, q in reqs for p in range(s, s + q))
    assert c128_boundary(convert(starts), convert(loc)) is brute


@pytest.mark.parametrize("num_reqs", [3, 40])  # the scan and the numpy path
def test_gate_rejects_negative_counts_on_both_paths(num_reqs):
    starts = np.full(num_reqs, 5, dtype=np.int64)
    loc = np.arange(num_reqs + 1, dtype=np.int64)
    loc[-1] = loc[-2] - 1  # the last request has qlen -1
    with pytest.raises(GeometryError, match="values >= 0"):
        c128_boundary(starts, loc)
    starts[1], loc[-1] = -128, loc[-2] + 1  # a negative start; -128 % 128 == 0 hides nothing
    with pytest.raises(GeometryError, match="values >= 0"):
        c128_boundary(starts, loc)


@pytest.mark.parametrize(
    ("starts", "loc", "match"),
    [
        ([0, 1], [0, 1], "query_start_loc: expected length 3, got 2"),
        ([3], [0, 2.5], "query_start_loc: expected a 1-D integer array"),
        ([-1], [0, 1], "values >= 0"),
        ([4], [3, 1], "values >= 0"),
        ([[1]], [0, 1], "num_computed_tokens: expected a 1-D integer array, got 2-D"),
    ],
)
def test_gate_rejects_bad_metadata(starts, loc, match):
    with pytest.raises(GeometryError, match=match):
        c128_boundary(np.array(starts), np.array(loc))


# --- kernels vs references -----------------------------------------------------------------

SCENARIOS = {
    # several requests, prefill crossing two boundaries, decodes at 126/127/128, a window
    # whose first 100 rows come from earlier steps, padding tokens in between
    "mixed": dict(reqs=[(0, 300), (126, 1), (127, 1), (128, 1), (100, 40)], num_pad=2),
    "decode_at_127_and_255": dict(reqs=[(127, 1), (255, 1), (40, 1)], num_pad=1),
    "fp32_inputs_block_16": dict(reqs=[(250, 9), (3, 125)], block_size=16, dtype=torch.float32),
    "small_head_dim": dict(reqs=[(60, 70), (383, 2)], head_dim=128, num_pad=1),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_kernels_match_reference(name):
    step = Step(7, **SCENARIOS[name])
    state, comp = run_kernels(step)
    state_ref, comp_ref = run_refs(step)
    # the state write is exact fp32 arithmetic; padding rows keep their poison
    assert torch.equal(state, state_ref)
    assert not torch.equal(state, step.state_cache)
    assert_entries_match(comp, comp_ref, step.compressed_cache, step.boundary_slots())


def test_layout_bytes_at_documented_offsets():
    step = Step(3, [(127, 1)])
    _, comp = run_kernels(step)
    entry = comp.view(-1, 584)[step.slot_mapping[0]].cpu()
    nope = entry[:448].view(torch.float8_e4m3fn).float().view(7, 64)
    exps = entry[576:583].int() - 127
    rope = entry[448:576].view(torch.bfloat16).float()
    # every group's scale is the smallest power of two that fits its amax into +-448
    amax = (nope * torch.exp2(exps.float())[:, None]).abs().amax(dim=1)
    assert (amax <= 448 * torch.exp2(exps.float())).all()
    assert (nope.abs().amax(dim=1) >= 224).all()
    assert entry[583] == 0
    _, rope_u, exps_u = c128_unpack(entry)
    assert torch.equal(rope_u, rope) and torch.equal(exps_u, exps)


def test_zero_window_uses_the_amax_floor():
    # a request whose whole window holds kv = 0: NoPE pools to 0, the scale floors at 1e-4
    step = Step(5, [(127, 1), (255, 1)])
    rows = step.state_block_table[0].long()
    step.state_cache[rows, :, : step.head_dim] = 0.0
    step.kv[0] = 0.0
    _, comp = run_kernels(step)
    entries = comp.view(-1, 584)[step.slot_mapping].cpu()
    floor_byte = 127 + math.ceil(math.log2(1e-4 / 448))
    assert entries[0, 576:583].tolist() == [floor_byte] * 7
    assert (entries[0, :576] == 0).all()
    assert (entries[1, 576:583] != floor_byte).all()


def test_launchers_reject_bad_tensors():
    step = Step(1, [(120, 8)])
    state = step.state_cache.clone()
    args = list(step.write_args(state))
    with pytest.raises(GeometryError, match=r"kv: expected shape \[8, 512\], got \[8, 256\]"):
        c128_state_write(args[0][:, :256], *args[1:])
    with pytest.raises(
        GeometryError,
        match=re.escape("positions: expected dtype in torch.int32/torch.int64, got torch.float32"),
    ):
        c128_state_write(*args[:3], args[3].float(), *args[4:])
    with pytest.raises(
        GeometryError,
        match=re.escape("state_cache: expected dtype in torch.float32, got torch.float16"),
    ):
        c128_state_write(*args[:5], state.half())
    comp_args = list(step.compress_args(state, step.compressed_cache.clone()))
    with pytest.raises(GeometryError, match=r"compressed_cache: expected shape \[\*, \*, 584\]"):
        c128_compress(*comp_args[:7], comp_args[7][..., :580])
    with pytest.raises(GeometryError, match=re.escape("eps: expected a float > 0, got 0.0")):
        c128_compress(*comp_args, eps=0.0)
    assert torch.equal(state, step.state_cache)  # nothing ran


# --- bounds: out-of-range indices, poisoned margins around every tensor ----------------------


class Fenced:
    """A copy of ``t`` in the middle of a bigger buffer whose margins hold ``fill``.

    A kernel that reads a margin picks up ``fill`` (chosen to look valid where that matters);
    one that writes a margin breaks :meth:`intact`.
    """

    MARGIN = 256  # elements each side (a multiple of 16 bytes for every dtype used here)

    def __init__(self, t: torch.Tensor, fill):
        self.fill = fill
        self.flat = torch.full((t.numel() + 2 * self.MARGIN,), fill, dtype=t.dtype, device=t.device)
        self.t = self.flat[self.MARGIN : self.MARGIN + t.numel()].view(t.shape)
        self.t.copy_(t)

    def intact(self) -> bool:
        margins = torch.cat([self.flat[: self.MARGIN], self.flat[-self.MARGIN :]])
        return bool((margins == self.fill).all())


def out_of_range_step() -> tuple[Step, dict[str, int]]:
    """A step whose boundary tokens hit every out-of-range case next to valid ones.

    Requests (block size 8, table width 20 = positions 0..159): r0 and r1 are valid boundary
    tokens; r2 at 255 reaches block 31, past the row (its read would land in r3's row); r3's
    window holds a table entry past the state cache; r4 holds a -1 entry. Extra tokens: a
    boundary token of r0 with a compressed slot at the capacity, one whose req index is the
    table's row count, one at a position past the RoPE table, and state slots at and past the
    state cache's capacity.
    """
    step = Step(91, [(127, 1), (100, 28), (255, 1), (127, 1), (127, 1)])
    step.state_block_table = step.state_block_table[:, :20].contiguous()
    num_state_blocks = step.state_cache.shape[0]
    step.state_block_table[3, 5] = num_state_blocks + 3
    step.state_block_table[4, 9] = -1
    capacity = step.compressed_cache.shape[0] * step.compressed_cache.shape[1]
    state_capacity = num_state_blocks * step.block_size
    extra = {  # name: (position, req, state slot, compressed slot)
        "slot_at_capacity": (127, 0, 5, capacity),
        "req_past_table": (127, 5, 6, 1),
        "rope_past_table": (step.cos_sin_cache.shape[0] + 127, 0, state_capacity, 2),
        "state_slot_far": (12, 0, state_capacity + 1000, 3),
    }
    for pos, req, state_slot, slot in extra.values():
        step.positions = torch.cat([step.positions, torch.tensor([pos], device=DEV)])
        step.req_indices = torch.cat([step.req_indices, torch.tensor([req], dtype=torch.int32, device=DEV)])  # fmt: skip
        step.state_slot_mapping = torch.cat([step.state_slot_mapping, torch.tensor([state_slot], dtype=torch.int32, device=DEV)])  # fmt: skip
        step.slot_mapping = torch.cat([step.slot_mapping, torch.tensor([slot], device=DEV)])
        for name in ("kv", "score"):
            row = getattr(step, name)[:1] * 0.5 + 1
            setattr(step, name, torch.cat([getattr(step, name), row]))
    # distinct slots for the valid tokens (the Step's permutation may repeat the new ones)
    step.slot_mapping[:-4] = torch.arange(step.slot_mapping.shape[0] - 4, device=DEV) + 4
    return step, {"capacity": capacity, "state_capacity": state_capacity}


def fence_all(step: Step) -> dict[str, Fenced]:
    """Every tensor of the step in a fenced buffer; tables' margins hold block 0 (valid)."""
    fills = {"state_block_table": 0, "compressed_cache": 0xA5, "positions": 127,
             "req_indices": 0, "slot_mapping": 0, "state_slot_mapping": 0}  # fmt: skip
    fenced = {}
    for name, value in list(vars(step).items()):
        if isinstance(value, torch.Tensor):
            fill = fills.get(name, 3.0)
            fenced[name] = Fenced(value, fill)
            setattr(step, name, fenced[name].t)
    return fenced


def test_out_of_range_indices_touch_nothing_outside_and_match_the_reference():
    step, _ = out_of_range_step()
    state_ref, comp_ref = run_refs(step)
    fenced = fence_all(step)
    state, comp = Fenced(step.state_cache, 5.0), Fenced(step.compressed_cache, 0x5A)
    c128_state_write(*step.write_args(state.t))
    c128_compress(*step.compress_args(state.t, comp.t))
    assert torch.equal(state.t, state_ref)
    assert all(f.intact() for f in fenced.values()) and state.intact() and comp.intact()
    # only r0's and r1's boundary tokens compress; every other slot keeps its poison
    written = step.boundary_slots()[:2]
    assert assert_entries_match(comp.t, comp_ref, step.compressed_cache, written) is None
    assert torch.equal(comp_ref.view(-1, 584)[step.slot_mapping[2:5].long()],
                       step.compressed_cache.view(-1, 584)[step.slot_mapping[2:5].long()])  # fmt: skip


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("state_slot", r"state_slot_mapping: expected slots < \d+ .*got \d+"),
        ("slot_at_capacity", r"compressed_slot_mapping: expected slots < \d+, got \d+"),
        ("req_past_table", r"req_indices: expected rows of the table in \[0, 2\), got 2"),
        ("window_past_row", r"positions // S: expected block indices < the table width 20, got 31"),
        ("entry_past_cache", r"state_block_table entries of boundary windows: expected blocks"),
        ("rope_past_table", r"\(positions // 128\) \* 128: expected rows of cos_sin_cache"),
    ],
)
def test_check_slots_raises_a_typed_error_before_launching(case, match):
    step = Step(92, [(127, 1), (255, 1)])
    capacity = step.compressed_cache.shape[0] * step.compressed_cache.shape[1]
    if case == "state_slot":
        step.state_slot_mapping[1] = step.state_cache.shape[0] * step.block_size
    elif case == "slot_at_capacity":
        step.slot_mapping[1] = capacity
    elif case == "req_past_table":
        step.req_indices[1] = 2
    elif case == "window_past_row":
        step.state_block_table = step.state_block_table[:, :20]
    elif case == "entry_past_cache":
        step.state_block_table[1, 17] = step.state_cache.shape[0]
    else:
        step.cos_sin_cache = step.cos_sin_cache[:100]
    hook = make_hook(step, check_slots=True)
    with pytest.raises(InvalidBlockError, match=match):
        hook(step.context())
    assert torch.equal(hook.state_cache, step.state_cache)  # nothing ran
    assert torch.equal(hook.compressed_cache, step.compressed_cache)
    state = step.state_cache.clone()
    with pytest.raises(InvalidBlockError, match=match):
        c128_state_write(*step.write_args(state), check_slots=True)
        c128_compress(*step.compress_args(state, step.compressed_cache.clone()), check_slots=True)
    make_hook(step)(step.context())  # without the check the same step runs (and skips)


def test_check_slots_passes_a_valid_step():
    step = Step(93, SCENARIOS["mixed"]["reqs"], num_pad=2)
    hook = make_hook(step, check_slots=True)
    hook(step.context())
    state, comp = run_refs(step)
    assert torch.equal(hook.state_cache, state)
    assert_entries_match(hook.compressed_cache, comp, step.compressed_cache, step.boundary_slots())


# --- hook ----------------------------------------------------------------------------------


def make_hook(step: Step, **kw) -> C128CompressorHook:
    return C128CompressorHook(
        state_cache=step.state_cache.clone(), compressed_cache=step.compressed_cache.clone(),
        ape=step.ape, norm_weight=step.norm_weight, cos_sin_cache=step.cos_sin_cache, **kw,
    )  # fmt: skip


def test_hook_skips_compress_only_when_gate_is_false():
    non_boundary = Step(11, [(126 - 10, 10), (3, 1)])
    hook = make_hook(non_boundary)
    assert isinstance(hook, StepHook)
    # 1. gate False, eager: state write only, compressed cache untouched
    report = hook(non_boundary.context())
    assert (report.launches, report.skips, report.extra["boundary"]) == (1, 1, False)
    assert torch.equal(hook.compressed_cache, non_boundary.compressed_cache)
    assert not torch.equal(hook.state_cache, non_boundary.state_cache)
    # 2. counts unknown: never skip
    report = hook(non_boundary.context(num_computed_tokens=None))
    assert (report.launches, report.skips, report.extra["boundary"]) == (2, 0, None)
    # 3. under capture: always launch; the kernel skips the non-boundary tokens itself
    report = hook(non_boundary.context(is_capturing=True))
    assert (report.launches, report.skips) == (2, 0)
    assert torch.equal(hook.compressed_cache, non_boundary.compressed_cache)
    # 4. ungated baseline always launches both kernels
    ungated = make_hook(non_boundary, gated=False)
    assert (ungated(non_boundary.context()).launches, ungated.num_skips) == (2, 0)
    assert (hook.num_steps, hook.num_launches, hook.num_skips) == (3, 5, 1)


def test_hook_carries_state_across_steps():
    # step 1: request 0 prefills 0..99, request 1 decodes at 126 (no boundary)
    # step 2: request 0 computes 100..139 (its window started in step 1), request 1 is at 127
    first = Step(21, [(0, 100), (126, 1)], num_pad=1, table_width=20)
    second = Step(22, [(100, 40), (127, 1)], table_width=20)
    for name in ("state_block_table", "state_cache", "compressed_cache", "ape", "norm_weight"):
        setattr(second, name, getattr(first, name))
    rows = second.state_block_table[second.req_indices.long(), second.positions // 8].long()
    second.state_slot_mapping = (rows * 8 + second.positions % 8).to(torch.int32)
    second.slot_mapping = torch.arange(second.positions.shape[0], device=DEV) + 1
    hook = make_hook(first)
    reports = [hook(first.context()), hook(second.context())]
    assert [(r.launches, r.skips) for r in reports] == [(1, 1), (2, 0)]
    state_ref, comp_ref = first.state_cache.clone(), first.compressed_cache.clone()
    c128_state_write_ref(*first.write_args(state_ref))
    c128_state_write_ref(*second.write_args(state_ref))
    c128_compress_ref(*second.compress_args(state_ref, comp_ref))
    assert torch.equal(hook.state_cache, state_ref)
    assert_entries_match(hook.compressed_cache, comp_ref, first.compressed_cache,
                         second.boundary_slots())  # fmt: skip


def test_hook_missing_tensor_launches_nothing():
    step = Step(4, [(127, 1)])
    hook = make_hook(step, name="layer7")
    with pytest.raises(GeometryError, match=r"expected keys \['layer7.kv', 'layer7.score'\]"):
        hook(step.context())
    assert torch.equal(hook.state_cache, step.state_cache)
    assert hook.num_steps == 0
    report = hook(step.context(name="layer7"))
    assert (report.name, report.launches) == ("layer7", 2)


class RecordingKernel:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kw)`` records instead of running."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, args, kw))


def test_hook_step_runs_no_torch_op_on_the_host(monkeypatch):
    # the per-step host path is attribute reads, the gate and the launches: a step that
    # dispatched any aten op (tensor creation, .item(), arithmetic, .to()) would cost several
    # microseconds per op and could synchronize with the device
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvmgr.kernels.c128 import host as kernels

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    write, compress = RecordingKernel(), RecordingKernel()
    monkeypatch.setattr(kernels, "state_write_kernel", write)
    monkeypatch.setattr(kernels, "compress_kernel", compress)
    non_boundary, boundary = Step(51, [(126, 1), (300, 1)]), Step(52, [(127, 1), (300, 1)])
    gated, ungated = make_hook(non_boundary), make_hook(non_boundary, gated=False)
    contexts = [non_boundary.context(), boundary.context()]
    with CountOps() as counter:
        reports = [hook(ctx) for ctx in contexts for hook in (gated, ungated)]
    assert counter.ops == []
    assert [(r.launches, r.skips) for r in reports] == [(1, 1), (2, 0), (2, 0), (2, 0)]
    assert len(write.launches) == 4 and len(compress.launches) == 3
    grid, args, kw = compress.launches[1]  # the gated hook at the boundary step
    assert grid == (2, 1, 1) and args[3] is boundary.positions and kw["num_warps"] == 4


@pytest.mark.parametrize(
    ("key", "bad", "match"),
    [
        ("c128.kv", lambda t: t[:, :256], r"kv: expected shape \[2, 512\], got \[2, 256\]"),
        ("c128.score", lambda t: t.half(), "score: expected dtype in torch.bfloat16"),
        ("positions", lambda t: t.float(), "positions: expected dtype in"),
        ("positions", lambda t: t[:, None], r"positions: expected shape \[\*\]"),
        ("c128.state_slot_mapping", lambda t: t[:1], r"state_slot_mapping: expected shape \[2\]"),
        ("c128.state_slot_mapping", lambda t: t.numpy(), "expected a torch.Tensor, got ndarray"),
        ("c128.req_indices", lambda t: t.repeat(2)[::2], "req_indices: expected unit last stride"),
        ("c128.slot_mapping", lambda t: t[:1], r"compressed_slot_mapping: expected shape \[2\]"),
        ("c128.state_block_table", lambda t: t.t(), "state_block_table: expected unit last"),
        ("c128.state_block_table", lambda t: t[0], r"state_block_table: expected shape \[\*, \*\]"),
    ],
)
def test_hook_rejects_malformed_step_tensors_before_launching(key, bad, match):
    step = Step(61, [(127, 1), (20, 1)])
    hook = make_hook(step)
    tensors = dict(step.context().tensors)
    tensors[key] = bad(tensors[key].cpu() if key == "c128.state_slot_mapping" else tensors[key])
    ctx = StepContext(num_computed_tokens=np.array([127, 20]), query_start_loc=np.array([0, 1, 2]),
                      tensors=tensors)  # fmt: skip
    with pytest.raises(GeometryError, match=match):
        hook(ctx)
    assert torch.equal(hook.state_cache, step.state_cache)
    assert hook.num_steps == 0


def test_gated_skip_does_not_check_compress_inputs():
    # documented: compress inputs are only checked when the compress launch is issued
    step = Step(62, [(126, 1)])
    hook = make_hook(step)
    ctx = step.context()
    tensors = {**ctx.tensors, "c128.req_indices": step.req_indices.float()}
    report = hook(StepContext(num_computed_tokens=ctx.num_computed_tokens,
                              query_start_loc=ctx.query_start_loc, tensors=tensors))  # fmt: skip
    assert (report.launches, report.skips) == (1, 1)
    with pytest.raises(GeometryError, match="req_indices: expected dtype"):
        make_hook(step, gated=False)(StepContext(tensors=tensors))


def test_hook_launches_through_the_shared_launchers():
    # each layer binds its own launches over one process-wide launcher per kernel (every layer
    # shares its compiled kernels); packed by default, Triton's own launch with
    # direct_launch=False (under the interpreter both take Triton's launch)
    from kvmgr.kernels.c128 import kernel as kernels
    from kvmgr.kernels.launch import shared_launcher

    step = Step(63, [(127, 1)])
    default, normal = make_hook(step)._layer, make_hook(step, direct_launch=False)._layer
    assert default._write.launcher is shared_launcher(kernels.state_write_kernel, True)
    assert default._compress.launcher is shared_launcher(kernels.compress_kernel, True)
    other = make_hook(step)._layer
    assert other._compress is not default._compress
    assert other._compress.launcher is default._compress.launcher
    assert normal._write.launcher is shared_launcher(kernels.state_write_kernel, False)
    assert not normal._write.launcher.direct and not normal._compress.launcher.direct
    for launches in (default._write, default._compress):
        assert launches.launcher.direct is (DEV == "cuda")  # never past Triton when interpreted


def test_gate_module_is_triton_free_and_reexported():
    import subprocess
    import sys
    from pathlib import Path

    import kvmgr
    from kvmgr.kernels import c128
    from kvmgr.kernels.c128 import api, gate

    assert c128.c128_boundary is api.c128_boundary is gate.c128_boundary is kvmgr.c128_boundary
    code = ("import sys, kvmgr; kvmgr.c128_boundary; import kvmgr.kernels.c128.gate; "
            "sys.exit('triton' in sys.modules or 'kvmgr.kernels.c128.kernel' in sys.modules)")  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0


# --- GPU: larger shapes and CUDA graphs ----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 16])
def test_gpu_large_batch_matches_reference(block_size):
    rng = np.random.default_rng(block_size)
    reqs = [(int(s), int(q)) for s, q in zip(rng.integers(0, 2000, 48), rng.integers(1, 3, 48))]
    reqs += [(0, 1024), (1000, 700), (127 * 5, 1)]
    step = Step(31, reqs, block_size=block_size, num_pad=5)
    state, comp = run_kernels(step)
    state_ref, comp_ref = run_refs(step)
    assert torch.equal(state, state_ref)
    assert_entries_match(comp, comp_ref, step.compressed_cache, step.boundary_slots())


@pytest.mark.gpu
@pytest.mark.parametrize("direct_launch", [False, True])
def test_gpu_graph_capture_replays_boundary_and_non_boundary_steps(direct_launch):
    step = Step(41, [(126, 1), (300, 1), (64, 1)])
    hook = make_hook(step, direct_launch=direct_launch)
    ctx = step.context(is_capturing=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    hook(step.context(stream=stream, num_computed_tokens=None))  # compile both, off capture
    torch.cuda.current_stream().wait_stream(stream)
    hook.state_cache.copy_(step.state_cache)
    hook.compressed_cache.copy_(step.compressed_cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        report = hook(ctx)
    assert (report.launches, report.skips) == (2, 0)
    # replay 1: positions 126/300/64: no boundary, nothing compressed
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(hook.compressed_cache, step.compressed_cache)
    state_ref = step.state_cache.clone()
    c128_state_write_ref(*step.write_args(state_ref))
    assert torch.equal(hook.state_cache, state_ref)
    # replay 2: the same static buffers advanced by one token: request 0 reaches 127
    step.positions += 1
    rows = step.state_block_table[step.req_indices.long(), step.positions // 8].long()
    step.state_slot_mapping.copy_((rows * 8 + step.positions % 8).to(torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    comp_ref = step.compressed_cache.clone()
    c128_state_write_ref(*step.write_args(state_ref))
    c128_compress_ref(*step.compress_args(state_ref, comp_ref))
    assert torch.equal(hook.state_cache, state_ref)
    assert_entries_match(hook.compressed_cache, comp_ref, step.compressed_cache,
                         step.boundary_slots())  # fmt: skip


def _offset_copy(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of ``t`` starting ``offset`` elements into a fresh buffer (unaligned for odd offsets)."""
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    out = buf[offset:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.gpu
def test_gpu_direct_launch_matches_reference_across_guards():
    # the direct launcher keys compiled kernels by dtype and 16-byte alignment of the tensors
    # (among others): alternate them and check every launch against the reference; each
    # variant runs twice from the poisoned caches (first call: a new key, compiled through
    # Triton's warmup; second: a cache hit)
    step = Step(71, [(0, 300), (127, 1), (40, 1)], num_pad=1)
    hook = make_hook(step, gated=False, direct_launch=True)
    base = {name: getattr(step, name) for name in ("kv", "score", "positions", "slot_mapping")}
    variants = [
        {},
        {"kv": _offset_copy(base["kv"], 1), "score": _offset_copy(base["score"], 3)},
        {"kv": base["kv"].float(), "score": base["score"].float()},
        {"positions": _offset_copy(base["positions"], 1)},
        {},
    ]
    for variant in variants:
        for name, value in {**base, **variant}.items():
            setattr(step, name, value)
        for _ in range(2):
            hook.state_cache.copy_(step.state_cache)
            hook.compressed_cache.copy_(step.compressed_cache)
            hook(step.context())
        torch.cuda.synchronize()
        state_ref, comp_ref = run_refs(step)
        assert torch.equal(hook.state_cache, state_ref)
        assert_entries_match(hook.compressed_cache, comp_ref, step.compressed_cache,
                             step.boundary_slots())  # fmt: skip
    layer = hook._layer
    assert layer._write.launcher.direct and layer._compress.launcher.direct  # never fell back
    assert all(b.is_packed for b in [*layer._write.bound(), *layer._compress.bound()])
    assert layer._write.launcher.num_compiled >= 2  # bf16 and fp32 rows: two keys at least


def test_bench_without_cuda_exits_2(capsys, monkeypatch):
    import argparse

    from kvmgr.bench import c128 as bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--prefill", "1", "128"])) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


class FakeEvent:
    """``torch.cuda.Event`` stand-in for the CPU dry run: host clock instead of device time."""

    def __init__(self, enable_timing=False):
        self.t = 0.0

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class FakeGraph:
    """``_capture`` stand-in: replaying runs the captured launches ``times`` times, eagerly."""

    def __init__(self, launches, times=1):
        self.launches, self.times = launches, times

    def replay(self):
        for _ in range(self.times):
            self.launches()


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the dry run needs the Triton interpreter (CPU only)"
)
def test_bench_dry_run_on_cpu(monkeypatch, tmp_path, capsys):
    # every path of `kvmgr bench c128` with the CUDA timing and capture replaced by host
    # stand-ins and the kernels under the interpreter: the GPU run must not be the first run
    import argparse
    import json

    from kvmgr.bench import c128 as bench

    monkeypatch.setattr(bench, "_DEVICE", "cpu")
    monkeypatch.setattr(bench, "_capture", FakeGraph)
    monkeypatch.setattr(bench, "_info", lambda: {"gpu": "none (CPU dry run)"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "c128.json"
    argv = ["--batch", "1", "3", "--prefill", "1", "130", "--steps", "1", "--repeats", "1",
            "--warmup", "0", "--graph-steps", "2", "--json", str(out)]  # fmt: skip
    assert bench.run(parser.parse_args(argv)) == 0
    result = json.loads(out.read_text())
    assert result["output_matches_reference"] is True
    # 2 batches x 2 steps x (2 eager Triton + 2 packed + 2 one-step + 2 two-step graphs)
    assert len(result["decode"]) == 32
    launches = {(r["batch"], r["step"], r["mode"], r["gated"]): r["launches"]
                for r in result["decode"]}  # fmt: skip
    assert launches[(3, "non-boundary", "eager", True)] == 1
    assert launches[(3, "boundary", "eager", True)] == 2
    targets = {(r["batch"], r["mode"], r["per_replay"]): r["target"] for r in result["ratios"]}
    assert targets == {(1, "eager", 1): 3.0, (1, "eager packed", 1): 3.0, (1, "graph", 1): None,
                       (1, "graph", 2): 1.8, (3, "eager", 1): None, (3, "eager packed", 1): None,
                       (3, "graph", 1): None, (3, "graph", 2): None}  # fmt: skip
    parts = {r["part"]: r for r in result["host_breakdown"]}
    assert len(parts) == 13 and parts["gate: c128_boundary"]["host_us"] > 0
    # the interpreter has no compiled kernels: the bound launches are Triton's
    assert parts["launch: compress, packed"]["note"] == "fell back to Triton's launch"
    assert "target <= 10 us" in parts["hook step, gated, packed"]["note"]
    assert [r["boundaries"] for r in result["prefill"]] == [0, 1]
    printed = capsys.readouterr().out
    assert (
        "Targets apply to batch" in printed
        and "boundary outputs match the reference: True" in printed
    )


def test_state_write_binds_once_per_signature_and_checks_t_agreement():
    # steps of different T share one bound launch; the cached signature leaves T out, so T is
    # still compared on every step and a disagreeing step raises before launching
    from kvmgr.kernels.c128.host import Layer

    base = Step(210, [(0, 60), (127, 1), (300, 2)])
    layer = Layer(base.state_cache.clone(), ape=base.ape)
    expected = base.state_cache.clone()
    for lo, hi in [(0, 5), (4, 6), (8, 63), (12, 40)]:  # starts keep 16-byte alignment
        rows = (base.kv[lo:hi], base.score[lo:hi], base.positions[lo:hi], base.state_slot_mapping[lo:hi])  # fmt: skip
        assert layer.launch_write(*rows) == hi - lo
        c128_state_write_ref(*rows[:2], base.ape, *rows[2:], expected)
    assert torch.equal(layer.state_cache, expected)
    assert layer._write.num_bound == 1
    with pytest.raises(GeometryError, match=r"kv: expected shape \[3, 512\], got \[2, 512\]"):
        layer.launch_write(base.kv[:2], base.score[:3], base.positions[:3], base.state_slot_mapping[:3])  # fmt: skip
    assert torch.equal(layer.state_cache, expected)


def _fresh(ctx: StepContext, **changes) -> StepContext:
    """``ctx`` with new step tensors (clones: new objects, new pointers), some replaced."""
    tensors = {k: v.clone() for k, v in ctx.tensors.items()}
    tensors.update({k: bad(tensors[k]) for k, bad in changes.items()})
    return StepContext(tensors=tensors, num_computed_tokens=ctx.num_computed_tokens,
                       query_start_loc=ctx.query_start_loc)  # fmt: skip


def _steady_writes(hook: C128CompressorHook, step: Step, expected: torch.Tensor) -> None:
    """Five gated steps with new step tensors (a steady serving loop), each state write checked
    against the reference; then the write is guarded (the one-check path is armed)."""
    for _ in range(5):
        ctx = _fresh(step.context())
        t = ctx.tensors
        c128_state_write_ref(t["c128.kv"], t["c128.score"], step.ape, t["positions"],
                             t["c128.state_slot_mapping"], expected)  # fmt: skip
        report = hook(ctx)
        assert (report.launches, report.skips) == (1, 1)
        assert torch.equal(hook.state_cache, expected)
    assert hook._layer._steady_write.entry is not None


@pytest.mark.parametrize(
    ("key", "bad", "match"),
    [
        ("c128.kv", lambda t: t.half(), "score: expected dtype in torch.float16"),
        ("c128.score", lambda t: t.float(), "score: expected dtype in torch.bfloat16"),
        ("c128.kv", lambda t: t[:1], r"kv: expected shape \[2, 512\], got \[1, 512\]"),
        ("c128.score", lambda t: t.t().contiguous().t(), "score: expected unit last stride"),
        ("positions", lambda t: t.float(), "positions: expected dtype in"),
        ("positions", lambda t: t[:, None], r"positions: expected shape \[\*\]"),
        ("c128.state_slot_mapping", lambda t: t[:1], r"state_slot_mapping: expected shape \[2\]"),
        ("c128.state_slot_mapping", lambda t: t.repeat(2)[::2], "unit last stride"),
        # meta: no storage, device index -1 as on the CPU (the interpreted kernels' memory)
        ("c128.kv", lambda t: torch.empty_like(t, device="meta"), "kv: expected device"),
        ("positions", lambda t: torch.empty_like(t, device="meta"), "positions: expected device"),
        pytest.param(
            "c128.state_slot_mapping",
            lambda t: t.cpu(),
            "state_slot_mapping: expected device",
            marks=pytest.mark.skipif(DEV == "cpu", reason="needs a CUDA GPU (one device here)"),
        ),
    ],
)
def test_a_bad_step_after_steady_steps_is_refused_before_launching(key, bad, match):
    # a steady loop's state writes run on one C++ guard of the step tensors (c128/_steady.py):
    # a new step tensor of another dtype, shape, stride or device must still raise the typed
    # error of a first step, launch nothing, and leave the state cache as it was
    step = Step(231, [(126, 1), (20, 1)])  # no request completes a window: gated, write only
    hook = make_hook(step)
    expected = step.state_cache.clone()
    _steady_writes(hook, step, expected)
    with pytest.raises(GeometryError, match=match):
        hook(_fresh(step.context(), **{key: bad}))
    assert torch.equal(hook.state_cache, expected)
    _steady_writes(hook, step, expected)  # and the loop goes on exactly


def test_a_slot_past_the_state_cache_after_steady_steps_is_refused_with_check_slots():
    step = Step(232, [(126, 1), (20, 1)])
    hook = make_hook(step, check_slots=True)
    expected = step.state_cache.clone()
    _steady_writes(hook, step, expected)
    capacity = step.state_cache.shape[0] * step.block_size

    def past(t):
        t[1] = capacity
        return t

    with pytest.raises(InvalidBlockError, match=r"state_slot_mapping: expected slots < \d+"):
        hook(_fresh(step.context(), **{"c128.state_slot_mapping": past}))
    assert torch.equal(hook.state_cache, expected)


def test_steady_writes_of_other_valid_layouts_leave_the_guard_and_are_exact():
    # same sizes, other valid layouts between steady steps: int32 positions, token-strided kv
    # rows, a score base 4 bytes past 16-byte alignment, another T; each is written exactly
    from kvmgr.kernels.c128.host import Layer

    base = Step(233, [(0, 6), (126, 1), (300, 1)])
    layer = Layer(base.state_cache.clone(), ape=base.ape)
    expected = base.state_cache.clone()
    rows = (base.kv, base.score, base.positions, base.state_slot_mapping)

    def write(args):
        c128_state_write_ref(*args[:2], base.ape, *args[2:], expected)
        assert layer.launch_write(*args) == args[2].shape[0]
        assert torch.equal(layer.state_cache, expected)

    def misaligned(t):
        storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        return storage[1:].view(t.shape).copy_(t)  # bf16: 2 bytes past the base

    others = {
        "int32 positions": lambda a: (a[0], a[1], a[2].int(), a[3]),
        "token-strided kv": lambda a: (torch.cat([a[0], a[0]], dim=-1)[:, :512], *a[1:]),
        "misaligned score": lambda a: (a[0], misaligned(a[1]), *a[2:]),
        "T = 3": lambda a: tuple(t[:3] for t in a),
    }
    for name, other in others.items():
        for _ in range(3):
            write(tuple(t.clone() for t in rows))
        assert layer._steady_write.entry is not None, name
        changed = other(tuple(t.clone() for t in rows))
        assert layer._steady_write.launch(*changed, None, False) is None, name
        write(changed)
