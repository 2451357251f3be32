"""GroupIndex: held grouped keys on prefix chains, and the orphans a removal leaves."""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmgr.groups import GroupedLayout, GroupIndex, GroupKeyError, GroupSpec, offload_key

FULL = GroupSpec(name="full", kind="full", block_size=16, page_bytes=(64,))
SWA = GroupSpec(name="swa", kind="sliding_window", block_size=16, page_bytes=(32,), window=33)
MAMBA = GroupSpec(name="mamba", kind="recurrent", block_size=32, page_bytes=(8,))
LAYOUT = GroupedLayout([FULL, SWA, MAMBA])


def chain(n: int, prefix: list[bytes] | None = None, salt: bytes = b"") -> list[bytes]:
    out = list(prefix or [])
    parent = out[-1] if out else b"root"
    while len(out) < n:
        parent = hashlib.blake2b(parent + salt + b"%d" % len(out), digest_size=16).digest()
        out.append(parent)
    return out


def store_all(index: GroupIndex, hs: list[bytes], groups: range = range(3)) -> list[bytes]:
    keys = []
    for g in groups:
        k = LAYOUT.keys(g, hs, range(LAYOUT.num_blocks(g, len(hs))))
        index.add_pending(hs, g, k)
        keys.extend(k)
    assert index.landed(keys) == []
    return keys


def test_full_block_eviction_orphans_everything_beyond_it() -> None:
    index = GroupIndex(LAYOUT)
    a = chain(8)
    b = chain(12, a[:6], salt=b"b")  # shares blocks 0..5 with a
    store_all(index, a)
    store_all(index, b)
    # the full-attention block 3 of the shared prefix leaves: nothing at or below it restores
    orphans = set(index.removed([offload_key(a[3], 0)]))
    beyond = {offload_key(h, g) for h in set(a[3:] + b[3:]) for g in range(3)}
    assert beyond & set(index.held_keys()) <= orphans
    index.forget(orphans)
    # left: what boundary 32 (the only one restorable) needs; block 2 served only 64 and up
    left = set(index.held_keys())
    assert left == {offload_key(h, g) for h in a[:2] for g in (0, 1)} | {offload_key(a[1], 2)}


def test_window_eviction_orphans_the_dead_boundaries_state_only() -> None:
    index = GroupIndex(LAYOUT)
    a = chain(8)
    store_all(index, a)
    # window block 6 leaves: boundaries 112 and 128 (blocks 6,7 / 5,6 ... 7) die; 128 needs 6, 7
    orphans = set(index.removed([offload_key(a[6], 1)]))
    # mamba state at 128 (named by a[7]) is needed by boundary 128 only: dead. Full blocks 6, 7
    # are needed only by boundaries >= 112, all dead now; window block 7 likewise.
    assert orphans == {
        offload_key(a[7], 2),
        offload_key(a[6], 0),
        offload_key(a[7], 0),
        offload_key(a[7], 1),
    }
    # the state at 96 and everything up to block 5 still serve boundary 96
    assert offload_key(a[5], 2) not in orphans


def test_pending_orphans_are_dropped_when_they_land() -> None:
    index = GroupIndex(LAYOUT)
    a = chain(4)
    store_all(index, a, range(2))
    late = LAYOUT.keys(2, a, range(2))
    index.add_pending(a, 2, late)  # the mamba states are still in flight
    orphans = index.removed([offload_key(a[0], 0)])
    assert set(orphans) == {offload_key(h, g) for h in a[1:] for g in (0, 1)} | {
        offload_key(a[0], 1)
    }
    assert index.landed(late) == late  # orphans found in flight come back on landing


def test_check_chain_rejects_a_hash_under_another_parent() -> None:
    index = GroupIndex(LAYOUT)
    a = chain(4)
    store_all(index, a)
    with pytest.raises(GroupKeyError, match="chain"):
        index.check_chain([a[0], a[2]])
    index.check_chain(a[:2] + chain(3, a[:2], salt=b"x")[2:])  # a fork is fine


def test_split_rejects_foreign_group() -> None:
    with pytest.raises(GroupKeyError):
        GroupIndex(LAYOUT).split(offload_key(b"h", 9))


# ---------------------------------------------------------------- property vs brute force

LAYOUTS = [
    LAYOUT,
    GroupedLayout(
        [  # a coarser full group, a wider window, a state per block
            GroupSpec(name="swa", kind="sliding_window", block_size=16, page_bytes=(8,), window=70),
            GroupSpec(name="full", kind="full", block_size=32, page_bytes=(8,)),
            GroupSpec(name="m", kind="recurrent", block_size=16, page_bytes=(8,)),
        ]
    ),
    GroupedLayout(
        [  # no prefix group at all
            GroupSpec(name="swa", kind="sliding_window", block_size=16, page_bytes=(8,), window=40),
            GroupSpec(name="m", kind="recurrent", block_size=32, page_bytes=(8,)),
        ]
    ),
]


def brute_needed(
    layout: GroupedLayout, held: set[tuple[bytes, int]], trees: list[list[bytes]]
) -> set[tuple[bytes, int]]:
    """Every held block some restorable boundary needs, by the definition."""
    needed: set[tuple[bytes, int]] = set()
    for hs in trees:
        for n in range(layout.boundary_tokens, len(hs) * 16 + 1, layout.boundary_tokens):
            need = {
                (hs[layout.block_hash_index(g, j)], g)
                for g, spec in enumerate(layout.groups)
                for j in spec.live_blocks(n)
            }
            if need <= held:
                needed |= need
    return needed


@settings(max_examples=80, deadline=None)
@given(
    which=st.integers(0, len(LAYOUTS) - 1),
    seed=st.integers(0, 2**32 - 1),
    removals=st.integers(1, 4),
)
def test_removed_returns_exactly_the_newly_unneeded_blocks(
    which: int, seed: int, removals: int
) -> None:
    layout, rng = LAYOUTS[which], random.Random(seed)
    trees = [chain(rng.randint(2, 10))]
    for k in range(rng.randint(0, 3)):
        base = rng.choice(trees)
        trees.append(chain(rng.randint(1, 12), base[: rng.randint(0, len(base))], b"%d" % k))
    index = GroupIndex(layout)
    for hs in trees:
        for g in range(len(layout.groups)):
            blocks = [j for j in range(layout.num_blocks(g, len(hs))) if rng.random() < 0.9]
            keys = layout.keys(g, hs, blocks)
            index.add_pending(hs, g, keys)
            index.landed(keys)
    for _ in range(removals):
        held = {index.split(k) for k in index.held_keys()}
        if not held:
            break
        victim = rng.choice(sorted(held))
        before = brute_needed(layout, held, trees)
        orphans = {index.split(k) for k in index.removed([offload_key(victim[0], victim[1])])}
        after = brute_needed(layout, held - {victim}, trees)
        assert not orphans & after, "an orphan is still needed"
        assert (before - after - {victim}) <= orphans, "a newly unneeded block was missed"
        index.forget(offload_key(h, g) for h, g in orphans)
