"""``put_many`` with blobs that are no C-contiguous buffer, on both backends.

Found by a new user (round 4, session 13, newuser15): a ``str``, ``None``, an ``int``, a strided
array or a generator of blobs raised a builtin ``TypeError`` from ``memoryview``/``len`` (the
protocol documents ``InvalidKeyError`` for a count mismatch; the standard is a typed error for
any bad input). Now: ``InvalidArgumentError`` (``InvalidKeyError`` for the count), nothing
stored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvmgr.errors import InvalidArgumentError, InvalidKeyError
from kvmgr.tiers import DiskTier, SharedTier

BAD_BLOBS: dict[str, Any] = {
    "str": ["xyz"],
    "none": [None],
    "int": [3],
    "strided": [np.zeros(64, dtype=np.uint8)[::2]],
    "good then bad": [b"ok", None],
}


async def _check(tier: Any) -> None:
    for name, blobs in BAD_BLOBS.items():
        keys = [b"k-%d" % i for i in range(len(blobs))]
        with pytest.raises(InvalidArgumentError, match="blob"):
            await tier.put_many(keys, blobs)
        assert not (await tier.contains_many(keys)).any(), name
    with pytest.raises(InvalidKeyError, match="one blob per key"):
        await tier.put_many([b"g"], (b for b in [b"x"]))
    with pytest.raises(InvalidKeyError, match="one blob per key"):
        await tier.put_many([b"g"], None)
    result = await tier.put_many([b"a", b"b"], [b"x" * 8, np.arange(8, dtype=np.uint8)])
    assert result.num_stored == 2


@pytest.mark.asyncio
async def test_disk_tier_refuses_bad_blobs_typed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "slots", slot_bytes=4096, num_slots=8)
    try:
        await _check(tier)
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_shared_tier_refuses_bad_blobs_typed(tier_server) -> None:
    tier = SharedTier(tier_server.url, single_tenant=True)
    try:
        await _check(tier)
    finally:
        await tier.aclose()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_slots": 2**60}, "bytes per file"),  # was OverflowError from posix_fallocate
        ({"num_slots": 2**52, "num_files": 2}, "bytes per file"),
        ({"direct": "no"}, "direct"),  # a string was taken as True
        ({"direct": 0}, "direct"),
        ({"persist_index": "false"}, "persist_index"),
        ({"num_slots": 4, "num_files": 5}, "num_files"),  # a file without a slot
    ],
)
def test_disk_tier_options_refused_before_any_file(
    tmp_path: Path, options: dict[str, Any], match: str
) -> None:
    from kvmgr.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        DiskTier(tmp_path / "slots", **{"slot_bytes": 4096, "num_slots": 8, **options})
    assert list(tmp_path.iterdir()) == []
