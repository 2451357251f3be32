"""``store_many``'s parents as ``swap_out``'s (newuser13's "self-parent inconsistency",
investigated by leftovers14): a key given as its own parent is refused by both, for a new, an
already stored and a repeated key, with nothing changed; a parent later in the call and a cycle
are treated alike. Only the default chain of an adjacent repeat names the key itself, and a
repeat's parent is not used: no error (documented in ``store_many``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvmgr import InvalidKeyError, ManagerConfig, OffloadManager
from kvmgr.testing import check_invariants

A, B, C = b"a" * 8, b"b" * 8, b"c" * 8


async def _outcome(call: Callable[[OffloadManager], Any], stored: list[bytes]) -> object:
    caches = [torch.randn(16, 4, 8) for _ in range(2)]
    async with OffloadManager(caches, ManagerConfig(num_cpu_blocks=8, engine="host")) as mgr:
        blocks = mgr.allocate("r", 6)
        if stored:
            first = mgr.store_many(blocks[4 : 4 + len(stored)], stored)
            await mgr.step()
            await first
        before = mgr.snapshot()
        try:
            future = call(mgr)
        except InvalidKeyError as exc:
            assert mgr.snapshot() == before  # nothing changed
            return ("InvalidKeyError", "own parent" in str(exc), "cycle" in str(exc))
        await mgr.step()
        await asyncio.wait_for(asyncio.shield(future), 5)
        check_invariants(mgr)
        snapshot = mgr.snapshot()
        return ("ok", sorted(snapshot.keys), dict(snapshot.key_parents))


CASES = {  # keys, parents, keys stored before
    "self-new": ([A], [A], []),
    "self-after-new": ([A, B], [None, B], []),
    "self-stored": ([A], [A], [A]),
    "self-stored-with-new": ([A, B], [A, A], [A]),
    "parent-later": ([A, B], [B, None], []),
    "cycle": ([A, B], [B, A], []),
    "parent-not-stored": ([B], [A], []),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", sorted(CASES))
async def test_store_many_and_swap_out_agree_on_parents(case: str) -> None:
    keys, parents, stored = CASES[case]
    many = await _outcome(
        lambda m: m.store_many([0, 1][: len(keys)], keys, parents=parents), stored
    )
    one = await _outcome(lambda m: m.swap_out([0, 1][: len(keys)], keys, parents), stored)
    assert many == one
    if case.startswith("self"):
        assert many == ("InvalidKeyError", True, False)


@pytest.mark.asyncio
async def test_a_repeated_key_as_its_own_parent() -> None:
    explicit = await _outcome(lambda m: m.store_many([0, 1], [A, A], parents=[None, A]), [])
    assert explicit == ("InvalidKeyError", True, False)  # the caller named it: refused
    default = await _outcome(lambda m: m.store_many([0, 1], [A, A]), [])
    assert default[0] == "ok" and default[1] == [A]  # the default chain's: the repeat counts
    other = await _outcome(lambda m: m.store_many([0, 1, 2], [A, B, B], parents=[None, A, C]), [])
    assert other[0] == "ok" and other[1] == [A, B]  # as present, its parent not used
