"""``KeyChains.check``'s test for a chain with gaps (percall3: every parent the previous key, a
root or outside the call, as a store whose present keys were skipped) decides as the walk of
every key does: random distinct keys with parents drawn from the previous key, earlier or later
keys of the call (cycles), keys outside it and ``None``, through ``check`` and ``walk_chains``."""

from __future__ import annotations

import random

import pytest

from kvmgr.errors import InvalidKeyError
from kvmgr.scheduler._key_cycles import chain_with_gaps, walk_chains
from kvmgr.scheduler.chains import KeyChains


def _raises(fn: object, *args: object) -> bool:
    try:
        fn(*args)  # type: ignore[operator]
    except InvalidKeyError:
        return True
    return False


@pytest.mark.parametrize("seed", range(6))
def test_the_gap_test_decides_as_the_walk(seed: int) -> None:
    rng, outcomes = random.Random(seed), set()
    chains = KeyChains(16, {})
    for _ in range(400):
        n = rng.randint(2, 12)
        keys = [b"k%d" % i for i in rng.sample(range(40), n)]
        parents: list[bytes | None] = [None, *keys[:-1]]
        for _ in range(rng.randint(0, 3)):  # a few gaps, and now and then a key of the call
            i = rng.randrange(n)
            parents[i] = rng.choice([None, b"out%d" % rng.randrange(5), rng.choice(keys)])
            if parents[i] == keys[i]:
                parents[i] = None  # (its own parent: refused before check)
        fast = _raises(chains.check, keys, parents)
        walked = _raises(walk_chains, keys, parents, {}, chains._up_block, chains.loose, False)
        assert fast == walked, (keys, parents)
        gaps = chain_with_gaps(keys, parents)
        assert not (gaps and fast)  # it never passes a cycle
        outcomes.add((fast, gaps))
    assert outcomes == {(False, True), (False, False), (True, False)}
