"""Cache group specs, grouped keys and the restorable-prefix lookup (kvmgr.groups.spec, .restore)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmgr.errors import ConfigError, InvalidKeyError
from kvmgr.groups import (
    GroupedLayout,
    GroupKeyError,
    GroupKind,
    GroupSpec,
    GroupSpecError,
    find_restorable,
    offload_key,
    plan_at,
    split_offload_key,
)


def full(name: str = "full", bs: int = 16, **kw: object) -> GroupSpec:
    return GroupSpec(name=name, kind="full", block_size=bs, page_bytes=(64, 64), **kw)


def swa(window: int, name: str = "swa", bs: int = 16) -> GroupSpec:
    return GroupSpec(
        name=name, kind="sliding_window", block_size=bs, page_bytes=(32,), window=window
    )


def mamba(bs: int = 16, name: str = "mamba") -> GroupSpec:
    return GroupSpec(name=name, kind=GroupKind.RECURRENT, block_size=bs, page_bytes=(8,))


def hashes(n: int, salt: bytes = b"") -> list[bytes]:
    out, parent = [], b"root" + salt
    for i in range(n):
        parent = hashlib.blake2b(parent + b"%d" % i, digest_size=16).digest()
        out.append(parent)
    return out


# ---------------------------------------------------------------- keys


def test_offload_key_is_vllms() -> None:
    base = pytest.importorskip("vllm.v1.kv_offload.base")
    h = hashes(1)[0]
    for gid in (0, 1, 7, 2**32 - 1):
        key = offload_key(h, gid)
        assert key == base.make_offload_key(h, gid)
        assert split_offload_key(key) == (
            base.get_offload_block_hash(key),
            base.get_offload_group_idx(key),
        )


@pytest.mark.parametrize("bad", [b"", "ab", None])
def test_offload_key_rejects_bad_hash(bad: object) -> None:
    with pytest.raises(GroupKeyError):
        offload_key(bad, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("gid", [-1, 2**32, True, 1.0])
def test_offload_key_rejects_bad_group(gid: object) -> None:
    with pytest.raises(InvalidKeyError):  # GroupKeyError is an InvalidKeyError
        offload_key(b"h", gid)  # type: ignore[arg-type]


def test_split_rejects_short_key() -> None:
    with pytest.raises(GroupKeyError):
        split_offload_key(b"abcd")


# ---------------------------------------------------------------- specs


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "full", "block_size": 0, "page_bytes": (8,)},
        {"kind": "full", "block_size": 16, "page_bytes": ()},
        {"kind": "full", "block_size": 16, "page_bytes": (0,)},
        {"kind": "nope", "block_size": 16, "page_bytes": (8,)},
        {"kind": "sliding_window", "block_size": 16, "page_bytes": (8,)},  # no window
        {"kind": "full", "block_size": 16, "page_bytes": (8,), "window": 4},
        {"kind": "sliding_window", "block_size": 16, "page_bytes": (8,), "window": 0},
        {"kind": "compressed", "block_size": 16, "page_bytes": (8,)},  # no ratio
        {"kind": "compressed", "block_size": 16, "page_bytes": (8,), "ratio": 3},
        {"kind": "compressed", "block_size": 16, "page_bytes": (8,), "ratio": 1},
        {"kind": "mla", "block_size": 16, "page_bytes": (8,), "ratio": 4},
        {"kind": "full", "block_size": 16, "page_bytes": (8,), "group_id": 2**32},
    ],
)
def test_bad_spec_raises(kwargs: dict[str, object]) -> None:
    with pytest.raises(GroupSpecError):
        GroupSpec(name="g", **kwargs)  # type: ignore[arg-type]


def test_bad_layout_raises() -> None:
    with pytest.raises(ConfigError):  # GroupSpecError is a ConfigError
        GroupedLayout([])
    with pytest.raises(GroupSpecError, match="names repeat"):
        GroupedLayout([full(), full()])
    with pytest.raises(GroupSpecError, match="ids repeat"):
        GroupedLayout([full(group_id=1), swa(8, bs=16), full("f2", group_id=0)])
    with pytest.raises(GroupSpecError, match="multiple of hash_block_size"):
        GroupedLayout([full(bs=24)], hash_block_size=16)
    with pytest.raises(GroupKeyError, match="unknown group"):
        GroupedLayout([full()]).index("swa")


def test_live_blocks_per_kind() -> None:
    # the next token at position N reads itself and W - 1 earlier tokens: [N - W + 1, N)
    assert swa(window=128, bs=16).live_blocks(256) == range(8, 16)  # 127 tokens: 8 blocks
    assert swa(window=129, bs=16).live_blocks(256) == range(8, 16)  # 128 tokens: 8 blocks
    assert swa(window=130, bs=16).live_blocks(256) == range(7, 16)  # 129 tokens: 9 blocks
    assert swa(window=1, bs=16).live_blocks(256) == range(16, 16)
    assert swa(window=4096, bs=16).live_blocks(256) == range(16)
    assert mamba().live_blocks(256) == range(15, 16)
    assert full().live_blocks(256) == range(16)
    assert mamba().live_blocks(0) == range(0)
    with pytest.raises(GroupKeyError):
        full().live_blocks(250)


def test_coarse_group_keys_use_the_last_hash_of_the_block() -> None:
    layout = GroupedLayout([full(bs=16), mamba(bs=64)], hash_block_size=16)
    hs = hashes(8)
    assert layout.boundary_tokens == 64
    assert layout.keys(1, hs, [0, 1]) == [offload_key(hs[3], 1), offload_key(hs[7], 1)]
    plan = plan_at(layout, hs, 128)
    assert plan.blocks == (range(8), range(1, 2))
    assert plan.num_bytes == 8 * 128 + 8
    with pytest.raises(GroupKeyError):
        plan_at(layout, hs, 96)  # not a boundary of the 64-token group


# ---------------------------------------------------------------- restorable prefix


def test_window_hole_blocks_only_the_boundaries_it_covers() -> None:
    layout = GroupedLayout([full(), swa(window=33)])  # window: 32 past tokens = 2 blocks
    hs = hashes(10)
    ready = set(layout.keys(0, hs, range(10))) | set(layout.keys(1, hs, range(10)))
    ready.discard(offload_key(hs[4], 1))  # sliding-window block 4 evicted
    plan = find_restorable(layout, hs, ready.__contains__)
    assert plan.num_tokens == 160  # boundaries 80 and 96 need block 4; 160 does not
    assert plan.blocks == (range(10), range(8, 10))  # only the window is loaded
    assert plan.num_bytes == 10 * 128 + 2 * 32
    ready.discard(offload_key(hs[8], 1))
    # 160 (blocks 8, 9) and 144 (7, 8) and 112..96 (block 4 at 96? 96 needs 4, 5) are out
    assert find_restorable(layout, hs, ready.__contains__).num_tokens == 128
    assert find_restorable(layout, hs, ready.__contains__, max_tokens=100).num_tokens == 64


def test_full_group_bounds_and_recurrent_needs_the_state() -> None:
    layout = GroupedLayout([full(), mamba()])
    hs = hashes(6)
    ready = set(layout.keys(0, hs, range(6))) | {offload_key(hs[2], 1), offload_key(hs[5], 1)}
    assert find_restorable(layout, hs, ready.__contains__).num_tokens == 96
    ready.discard(offload_key(hs[1], 0))  # the prefix ends at block 1
    assert find_restorable(layout, hs, ready.__contains__).num_tokens == 0
    assert find_restorable(layout, hs, lambda k: True).blocks == (range(6), range(5, 6))


def test_find_restorable_rejects_bad_input() -> None:
    layout = GroupedLayout([full()])
    with pytest.raises(GroupKeyError):
        find_restorable(layout, [b"a", ""], lambda k: True)  # type: ignore[list-item]
    with pytest.raises(GroupKeyError):
        find_restorable(layout, b"ab", lambda k: True)  # type: ignore[arg-type]
    with pytest.raises(GroupKeyError):
        find_restorable(layout, [b"a"], lambda k: True, max_tokens=-1)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 24),
    window=st.integers(1, 80),
    bs_mamba=st.sampled_from([16, 32]),
    missing=st.sets(st.tuples(st.integers(0, 2), st.integers(0, 23)), max_size=8),
)
def test_find_restorable_is_the_brute_force_maximum(
    n: int, window: int, bs_mamba: int, missing: set[tuple[int, int]]
) -> None:
    layout = GroupedLayout([full(), swa(window), mamba(bs_mamba)])
    hs = hashes(n)
    ready = {
        k
        for g in range(3)
        for j, k in enumerate(layout.keys(g, hs, range(layout.num_blocks(g, n))))
        if (g, j) not in missing
    }
    plan = find_restorable(layout, hs, ready.__contains__)
    best = 0
    for tokens in range(layout.boundary_tokens, n * 16 + 1, layout.boundary_tokens):
        if all(k in ready for ks in plan_at(layout, hs, tokens).keys for k in ks):
            best = tokens
    assert plan.num_tokens == best
    assert all(k in ready for ks in plan.keys for k in ks)


def test_scheduler_side_imports_no_torch() -> None:
    code = "import sys, kvmgr.groups; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_explicit_group_ids_name_the_keys() -> None:
    layout = GroupedLayout([full(group_id=7), swa(33, bs=16)])
    hs = hashes(2)
    assert layout.keys(0, hs, [1]) == [offload_key(hs[1], 7)]
    assert layout.keys(1, hs, [1]) == [offload_key(hs[1], 1)]
    ready = {offload_key(h, 7) for h in hs} | {offload_key(h, 1) for h in hs}
    assert find_restorable(layout, hs, ready.__contains__).num_tokens == 32


def test_mla_and_compressed_groups_need_the_whole_prefix() -> None:
    mla = GroupSpec(name="mla", kind="mla", block_size=16, page_bytes=(576 * 16,))
    c4 = GroupSpec(name="c4", kind="compressed", block_size=64, page_bytes=(584 * 16,), ratio=4)
    layout = GroupedLayout([mla, c4])
    hs = hashes(8)
    assert layout.boundary_tokens == 64
    ready = set(layout.keys(0, hs, range(8))) | set(layout.keys(1, hs, range(2)))
    assert find_restorable(layout, hs, ready.__contains__).blocks == (range(8), range(2))
    ready.discard(offload_key(hs[3], 1))  # compressed block 0 (named by hash 3) left
    assert find_restorable(layout, hs, ready.__contains__).num_tokens == 0
