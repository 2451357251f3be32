"""DeepSeek-V4 state round trip: offload a request at an arbitrary boundary, evict, reload, go on.

Scenario (``run_scenario``): requests A and B run through a miniature serving loop
(``dsv4_engine.Engine``) whose c128 layers are ``C128CompressorHook``s (Triton: the interpreter on
CPU, the GPU in ``gpu`` tests) and whose c4 / indexer / sliding-window writers are the torch
references. After a random prefix (chunked prefills, then decode steps) that leaves A at a
random boundary N (not a multiple of 4, so not 128-aligned either), the engine is forked: the
baseline keeps A on the GPU; the other copy stores A's live blocks of every cache group through
``DeepSeekV4Offload`` (one ``OffloadManager`` per group), frees and poisons them, lets B run
(reusing A's blocks), reloads A into fresh poisoned blocks and continues. Both copies run the
same steps; afterwards every byte either request still reads (all compressed and indexer
entries, the SWA window, the compressor states of the unfinished windows) must be equal, and
the continuation must have crossed a c128, a c4 and a block boundary on A's restored state.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from dsv4_engine import Engine, Model

from kvmgr.errors import (
    ConfigError,
    GeometryError,
    InvalidArgumentError,
    InvalidBlockError,
    InvalidKeyError,
    UnknownKeyError,
)
from kvmgr.models.deepseek_v4 import DeepSeekV4Layout, DeepSeekV4Offload, boundary_keys

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ENGINE = "auto" if DEV == "cuda" else "host"
#: Small shapes for the interpreter: an SWA-only, a CSA and two HCA layers, head dim 128.
TINY = DeepSeekV4Layout(compress_ratios=(0, 4, 128, 128), head_dim=128)


@pytest.fixture(autouse=True)
def _one_thread():
    """The references run many tiny torch ops: one intra-op thread is several times faster on
    a loaded 2-core machine (and changes no result)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape, f"{what} {name}: shapes differ"
        if not torch.equal(got[name], want[name]):
            bad = (got[name] != want[name]).any(dim=-1).nonzero().flatten().tolist()
            raise AssertionError(f"{what} {name}: rows {bad[:8]} differ ({len(bad)} rows)")


def schedule(rng: random.Random, start: int, end: int, *, decode_from: int) -> list[int]:
    """Chunk sizes taking a request from ``start`` to ``end`` tokens: prefill chunks, then
    decode steps of 1-3 tokens from ``decode_from``."""
    out, n = [], start
    while n < end:
        q = rng.randint(17, 97) if n < decode_from else rng.randint(1, 3)
        q = min(q, end - n)
        out.append(q)
        n += q
    return out


def num_blocks(layout: DeepSeekV4Layout, max_tokens: int) -> dict[str, int]:
    """Blocks per group for two requests of up to ``max_tokens`` (window groups: their window
    plus the largest step, twice over, plus spares)."""
    out = {}
    for g in layout.groups:
        span = max_tokens if g.kind == "prefix" else 128 + 100 + 2 * g.block_size
        out[g.name] = 2 * (-(-span // g.block_size) + 2) + 8
    return out


async def run_scenario(layout: DeepSeekV4Layout, seed: int, *, kernel_hooks: bool,
                       num_tokens: tuple[int, int], drop: str | None = None) -> None:  # fmt: skip
    """The scenario of the module docstring; ``drop`` leaves one group unloaded (must fail)."""
    rng = random.Random(seed)
    block = layout.block_size
    n_a = rng.choice([n for n in range(*num_tokens) if n % 4])
    end_a = max(n_a + rng.randint(150, 220), (n_a // block + 1) * block + rng.randint(1, 20))
    n_b = rng.randint(60, 200)
    a_steps = schedule(rng, 0, n_a, decode_from=n_a - rng.randint(3, 9))
    b_steps = schedule(rng, 0, n_b, decode_from=n_b)
    gap = schedule(rng, n_b, n_b + rng.randint(9, 30), decode_from=n_b)
    n_b += sum(gap)
    tail_a = schedule(rng, n_a, end_a, decode_from=n_a + rng.randint(0, 60))
    tail_b = schedule(rng, n_b, n_b + rng.randint(40, 120), decode_from=n_b)
    model = Model(layout, max(end_a, n_b + sum(tail_b)) + 8, seed, DEV)
    engine = Engine(model, num_blocks(layout, end_a), kernel_hooks=kernel_hooks, engine=ENGINE,
                    seed=seed)  # fmt: skip
    async with engine.offload:
        # 1. the shared prefix: A's chunks, B joining at a random step
        join = rng.randint(0, len(a_steps) - 1)
        for i, q in enumerate(a_steps):
            await engine.step(
                [("A", q)] + ([("B", b_steps.pop(0))] if i >= join and b_steps else [])
            )
        while b_steps:
            await engine.step([("B", b_steps.pop(0))])
        # 2. fork: the baseline keeps A on the GPU (idle during the gap); the twin offloads it
        base, off = engine, engine.fork(seed + 1)
        a_at_n = base.live("A")
        tail = [[("A", q)] + ([("B", tail_b[i])] if i < len(tail_b) else [])
                for i, q in enumerate(tail_a)]  # fmt: skip
        for q in gap:
            await base.step([("B", q)])
        for work in tail:
            await base.step(work)
    async with off.offload:
        req = off.requests["A"]
        keys = (req.block_keys(), req.boundary_key(n_a))
        stored = off.offload.store(n_a, req.tables, *keys)
        await off.step([("B", gap[0])])  # this step flushes the stores
        await stored
        a = off.evict("A")  # poison and free every block of A; B may take them now
        for q in gap[1:-1]:
            await off.step([("B", q)])
        assert off.offload.is_restorable(n_a, *keys)
        fresh = {
            g.name: off.allocate(g.name, len(layout.blocks_at(g.name, n_a))) for g in layout.groups
        }
        if drop is None:
            loaded = off.offload.load(n_a, fresh, *keys)
        else:  # every group but ``drop``: its fresh blocks keep their poison
            every = off.offload.keys(n_a, *keys)
            loaded = asyncio.gather(*(off.offload.managers[g].swap_in(every[g], fresh[g])
                                      for g in fresh if g != drop and every[g]))  # fmt: skip
        await off.step([("B", gap[-1])])  # this step flushes the loads
        await loaded
        off.install(a, fresh)
        assert_same(off.live("A"), a_at_n, "A right after the reload:")
        for work in tail:
            await off.step(work)
    # 3. every byte A and B still read is the same; A's continuation crossed a 128-token
    #    window, c4 windows and a compressed block on its restored state
    for name in ("A", "B"):
        assert_same(off.live(name), base.live(name), f"request {name} at the end:")
    assert n_a % 4 and end_a // 128 > n_a // 128 and end_a // block > n_a // block


# --- the round trip ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_round_trip_with_the_c128_hook_is_bit_exact():
    await run_scenario(TINY, 20261201, kernel_hooks=True, num_tokens=(260, 400))


@pytest.mark.asyncio
@pytest.mark.parametrize(("seed", "block_size"), [(1, 128), (2, 256), (3, 384)])
async def test_round_trip_with_references_is_bit_exact(seed, block_size):
    # fast (torch references for c128 too): random boundaries, schedules and block sizes
    layout = DeepSeekV4Layout(
        compress_ratios=(4, 128, 0, 4, 128), head_dim=128, block_size=block_size
    )
    await run_scenario(layout, seed, kernel_hooks=False, num_tokens=(130, 520))


@pytest.mark.asyncio
@pytest.mark.parametrize("group", ["compressed", "swa", "c4_state", "c128_state"])
async def test_a_group_left_unloaded_is_caught(group):
    # the negative control: without one group's blocks the restored request reads poison
    with pytest.raises(AssertionError, match="differ"):
        await run_scenario(TINY, 7, kernel_hooks=False, num_tokens=(130, 250), drop=group)


@pytest.mark.gpu
@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [1, 2])
async def test_gpu_round_trip_flash_layout_is_bit_exact(seed):
    await run_scenario(DeepSeekV4Layout.flash(), seed, kernel_hooks=True, num_tokens=(700, 1600))


# --- the layout ----------------------------------------------------------------------------


def test_presets_have_the_published_layer_counts_and_pages():
    flash, pro = DeepSeekV4Layout.flash(), DeepSeekV4Layout.pro()
    assert [len(flash.layers(r)) for r in (0, 4, 128)] == [2, 21, 20]
    assert [len(pro.layers(r)) for r in (0, 4, 128)] == [0, 30, 31]
    pages = {g.name: g.page_bytes for g in flash.groups}
    assert pages == {
        "compressed": 21 * 64 * (584 + 132) + 20 * 2 * 584,
        "swa": 43 * 64 * 584,
        "c4_state": 21 * 4 * (4 * 512 + 4 * 128) * 4,
        "c128_state": 20 * 8 * 2 * 512 * 4,
    }


@pytest.mark.parametrize(
    ("n", "swa", "c4", "c128"),
    [(1, 0, 0, 0), (4, 0, 0, 0), (7, 0, 0, 0), (8, 0, 4, 0), (127, 0, 120, 0),
     (128, 1, 124, 128), (130, 3, 124, 128), (300, 173, 296, 256), (512, 385, 508, 512)],
)  # fmt: skip
def test_live_start_table(n, swa, c4, c128):
    layout = DeepSeekV4Layout.flash()
    got = [layout.live_start(g, n) for g in ("swa", "c4_state", "c128_state", "compressed")]
    assert got == [swa, c4, c128, 0]


def test_blocks_at_cover_exactly_the_live_positions():
    layout = DeepSeekV4Layout.flash()
    for n in range(1, 1200):
        for g in layout.groups:
            start, blocks = layout.live_start(g.name, n), layout.blocks_at(g.name, n)
            if start == n:
                assert len(blocks) == 0
                continue
            assert blocks.start * g.block_size <= start < (blocks.start + 1) * g.block_size
            assert (blocks.stop - 1) * g.block_size < n <= blocks.stop * g.block_size


def test_keys_share_full_blocks_and_name_the_rest_by_boundary():
    layout = DeepSeekV4Layout.flash()
    blocks = [bytes([i]) * 16 for i in range(4)]
    at_600, at_601 = (boundary_keys(layout, n, blocks, b"prefix-%d" % n) for n in (600, 601))
    assert at_600["compressed"][:2] == blocks[:2] == at_601["compressed"][:2]
    assert at_600["compressed"][2] != at_601["compressed"][2]  # the partial block is the boundary's
    assert not set(at_600["c128_state"]) & set(at_601["c128_state"])
    assert [len(at_600[g]) for g in ("swa", "c4_state", "c128_state")] == [3, 1, 11]
    assert [len(at_601[g]) for g in ("swa", "c4_state", "c128_state")] == [3, 2, 12]


@pytest.mark.parametrize(
    ("kw", "error"),
    [({"compress_ratios": (0, 8)}, ConfigError), ({"compress_ratios": ()}, ConfigError),
     ({"compress_ratios": (4,), "block_size": 200}, ConfigError),
     ({"compress_ratios": (4,), "head_dim": 96}, ConfigError)],
)  # fmt: skip
def test_bad_layouts_are_refused(kw, error):
    with pytest.raises(error):
        DeepSeekV4Layout(**kw)


def test_bad_boundaries_are_refused():
    layout = DeepSeekV4Layout.flash()
    with pytest.raises(InvalidArgumentError):
        layout.live_start("swa", -1)
    with pytest.raises(InvalidArgumentError):
        layout.live_start("mamba", 10)
    with pytest.raises(InvalidArgumentError):
        boundary_keys(layout, 0, [], b"k")
    with pytest.raises(InvalidKeyError):
        boundary_keys(layout, 600, [b"a"], b"k")  # two full blocks need two keys


@pytest.mark.asyncio
async def test_offload_refuses_bad_tables_and_unknown_restore_points_before_queuing():
    model = Model(TINY, 400, 3, DEV)
    engine = Engine(model, num_blocks(TINY, 400), kernel_hooks=False, engine=ENGINE, seed=3)
    async with engine.offload:
        await engine.step([("A", 150)])
        req, offload = engine.requests["A"], engine.offload
        keys = (req.block_keys(), req.boundary_key(150))
        # 1. a live block missing from a table: nothing is queued in any group
        tables = {**req.tables, "swa": [-1] * len(req.tables["swa"])}
        with pytest.raises(InvalidBlockError, match="swa"):
            offload.store(150, tables, *keys)
        assert all(m.statistics().queued_swaps == 0 for m in offload.managers.values())
        # 2. a restore point never stored, and wrong block counts for a stored one
        with pytest.raises(UnknownKeyError):
            offload.load(
                150, {g: [0] * len(TINY.blocks_at(g, 150)) for g in offload.managers}, *keys
            )
        stored = offload.store(150, req.tables, *keys)
        await engine.step([("B", 5)])
        await stored
        with pytest.raises(InvalidBlockError, match="expected"):
            offload.load(150, {g: [] for g in offload.managers}, *keys)
        assert all(m.statistics().queued_swaps == 0 for m in offload.managers.values())
    # 3. managers that do not manage the layout's tensors
    with pytest.raises(GeometryError):
        DeepSeekV4Offload(TINY, {"compressed": engine.offload.managers["compressed"]})


# --- the benchmark -------------------------------------------------------------------------


def test_bench_dsv4_runs_and_restores_bit_exact(tmp_path, capsys):
    import json

    from kvmgr.cli import main

    out = tmp_path / "dsv4.json"
    args = ["bench", "dsv4", "--preset", "tiny", "--boundaries", "301", "--repeats", "2"]
    assert main([*args, "--hidden-size", "256", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["restored_bit_exact"] is True
    (row,) = result["rows"]
    assert row["tail_tokens"] == {"swa": 127, "c4_state": 5, "c128_state": 45}
    layout = DeepSeekV4Layout(compress_ratios=(0, 4, 128, 128), head_dim=128)
    partial = layout.group("compressed").page_bytes  # 301 % 256: one partial block
    window = sum(len(layout.blocks_at(g.name, 301)) * g.page_bytes for g in layout.groups[1:])
    assert row["sidecar_bytes"] == partial + window
    assert "| 301 |" in capsys.readouterr().out
