"""kvmgr's KV events decoded by vLLM's own classes (issue 28 part 3).

1. The bytes: a batch of every event shape kvmgr emits (a stored chain with a break, token ids,
   a lower tier's stored keys without parents, removals from two media, the close's clear)
   encodes to exactly the bytes vLLM's encoder gives the same content built with vLLM's classes,
   and vLLM's typed decoder reads it back to those objects.
2. The block hashes: ``hash_format="int"`` equals vLLM's ``maybe_convert_block_hash``.
3. A router's view: a seeded run of stores (with evictions), loads and invalidations, each step's
   events decoded with vLLM's decoder and applied to an index as a router applies them; after
   every step the index holds exactly the READY keys of the CPU tier (never a key the tier
   cannot serve), with their parents and token ids; after close it is empty.

vLLM is required (``KVMGR_REQUIRE_VLLM=1`` in CI): see tests/vllm_events_support.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import random

import msgspec
import numpy as np
import pytest
import torch
from vllm_events_support import vllm_kv_events

from kvmgr import BlockStateError, ManagerConfig, OffloadManager, PoolExhaustedError
from kvmgr.events import TierMedium, VllmEventFormat, encode_batch
from kvmgr.reports import KVEvent

K = [hashlib.sha256(f"block{i}".encode()).digest() for i in range(64)]
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def ve():  # type: ignore[no-untyped-def]
    return vllm_kv_events()


def _low64(key: bytes) -> int:
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


def _sample_events() -> list[KVEvent]:
    tokens = np.arange(3 * BLOCK_SIZE, dtype=np.int32).reshape(3, BLOCK_SIZE) + 1000
    return [
        KVEvent("removed", (K[9], K[8])),
        # K0 <- K1 is a chain; K5 starts another one below K4 (not in the event)
        KVEvent("stored", (K[0], K[1], K[5]), "cpu", (None, K[0], K[4]), tokens),
        KVEvent("stored", (K[2], K[3]), "disk"),  # a lower tier: no parents, no tokens
        KVEvent("removed", (K[2],), "shared"),
        KVEvent("cleared", (), "all"),
    ]


def _vllm_expected(ve, fmt: VllmEventFormat, h) -> list[object]:  # type: ignore[no-untyped-def]
    """The same content built with vLLM's classes, field by field."""
    tokens = list(range(1000, 1000 + 3 * BLOCK_SIZE))
    common = {
        "group_idx": fmt.group_idx,
        "kv_cache_spec_kind": fmt.kv_cache_spec_kind,
        "kv_cache_spec_sliding_window": fmt.sliding_window,
    }
    stored = {"lora_id": None, "lora_name": None, **common}
    return [
        ve.BlockRemoved(block_hashes=[h(K[9]), h(K[8])], medium="CPU", group_idx=fmt.group_idx),
        ve.BlockStored(
            block_hashes=[h(K[0]), h(K[1])],
            parent_block_hash=None,
            token_ids=tokens[: 2 * BLOCK_SIZE],
            block_size=BLOCK_SIZE,
            medium="CPU",
            **stored,
        ),
        ve.BlockStored(
            block_hashes=[h(K[5])],
            parent_block_hash=h(K[4]),
            token_ids=tokens[2 * BLOCK_SIZE :],
            block_size=BLOCK_SIZE,
            medium="CPU",
            **stored,
        ),
        *(
            ve.BlockStored(
                block_hashes=[h(k)],
                parent_block_hash=None,
                token_ids=[],
                block_size=BLOCK_SIZE,
                medium="STORAGE",
                ownership="disk",
                **stored,
            )
            for k in (K[2], K[3])
        ),
        ve.BlockRemoved(
            block_hashes=[h(K[2])],
            medium="STORAGE",
            group_idx=fmt.group_idx,
            locality="REMOTE",
            ownership="valkey",
        ),
        ve.AllBlocksCleared(),
    ]


# ====================================================================== 1. bytes


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
@pytest.mark.parametrize("group", [None, (3, "sliding_window", 128)])
@pytest.mark.parametrize("rank", [None, 2])
def test_our_bytes_are_vllms_bytes_and_vllm_decodes_them(ve, hash_format, group, rank) -> None:  # type: ignore[no-untyped-def]
    group_kw = {} if group is None else dict(zip(("group_idx", "kv_cache_spec_kind",
                                                  "sliding_window"), group))  # fmt: skip
    fmt = VllmEventFormat(
        hash_format=hash_format,
        block_size=BLOCK_SIZE,
        media={"cpu": TierMedium(medium="CPU"),
               "disk": TierMedium(medium="STORAGE", ownership="disk"),
               "shared": TierMedium(medium="STORAGE", locality="REMOTE", ownership="valkey")},
        **group_kw,
    )  # fmt: skip
    ours = encode_batch(fmt.batch(_sample_events(), ts=1765000000.25, data_parallel_rank=rank))
    h = _low64 if hash_format == "int" else (lambda k: k)
    expected = ve.KVEventBatch(
        ts=1765000000.25, events=_vllm_expected(ve, fmt, h), data_parallel_rank=rank
    )
    assert ours == msgspec.msgpack.Encoder().encode(expected)  # what vLLM's publisher sends
    decoded = msgspec.msgpack.Decoder(type=ve.KVEventBatch).decode(ours)
    assert decoded == expected


def test_only_the_tiers_listed_are_published(ve) -> None:  # type: ignore[no-untyped-def]
    # lower tiers drop keys on their own, unheard: by default only the CPU tier is published
    batch = VllmEventFormat().batch(_sample_events(), ts=1.0)
    kinds = [(type(e).__name__, getattr(e, "medium", None)) for e in batch.events]
    assert kinds == [("BlockRemoved", "CPU"), ("BlockStored", "CPU"), ("BlockStored", "CPU"),
                     ("AllBlocksCleared", None)]  # fmt: skip
    decoded = msgspec.msgpack.Decoder(type=ve.KVEventBatch).decode(encode_batch(batch))
    assert len(decoded.events) == 4


def test_int_hashes_are_vllms_conversion() -> None:
    vllm_kv_events()
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    fmt = VllmEventFormat()
    for key in (*K[:8], b"\x01" * 3, b"\xff" * 40):
        assert fmt.block_hash(key) == maybe_convert_block_hash(key)


# ====================================================================== 3. a router's view


class _RouterIndex:
    """What a router keeps from vLLM events: hash -> (parent hash, token ids, medium)."""

    def __init__(self, ve) -> None:  # type: ignore[no-untyped-def]
        self.ve = ve
        self.decoder = msgspec.msgpack.Decoder(type=ve.KVEventBatch)
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, payload: bytes) -> None:
        for event in self.decoder.decode(payload).events:
            if isinstance(event, self.ve.BlockStored):
                assert event.medium == "CPU" and event.block_size == BLOCK_SIZE
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    assert block_hash not in self.blocks, "stored twice without a removal"
                    rows = event.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
                    self.blocks[block_hash] = (parent, tuple(rows))
                    parent = block_hash
            elif isinstance(event, self.ve.BlockRemoved):
                for block_hash in event.block_hashes:
                    del self.blocks[block_hash]  # raises if it was never advertised
            else:
                assert isinstance(event, self.ve.AllBlocksCleared)
                self.blocks.clear()


def _request_tokens(key_index: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(key_index).integers(0, 150_000, BLOCK_SIZE))


@pytest.mark.asyncio
async def test_a_router_fed_our_events_holds_exactly_the_ready_keys(ve) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(28)
    gen = torch.Generator().manual_seed(28)
    kv = [torch.randint(1, 256, (32, 256), dtype=torch.uint8, generator=gen) for _ in range(2)]
    cfg = ManagerConfig(num_cpu_blocks=12, engine="host", manage_gpu_blocks=False)
    fmt = VllmEventFormat(block_size=BLOCK_SIZE)
    router = _RouterIndex(ve)
    parent_of: dict[bytes, bytes | None] = {}
    async with OffloadManager(kv, cfg) as mgr:
        for step in range(40):
            # 1. a few "requests" store a run of their chain (prefix i..j of one of 4 chains)
            futures = []
            for _ in range(rng.randint(1, 3)):
                chain = rng.randrange(4)
                start, length = rng.randrange(6), rng.randint(1, 4)
                idx = [chain * 16 + i for i in range(start, start + length)]
                keys = [K[i] for i in idx]
                parents = [K[i - 1] if i % 16 else None for i in idx]
                parent_of.update(zip(keys, parents))
                tokens = np.array([_request_tokens(i) for i in idx])
                gpu = rng.sample(range(32), length)
                with contextlib.suppress(PoolExhaustedError):
                    futures.append(mgr.store_many(gpu, keys, parents=parents, token_ids=tokens))
            # 2. now and then a load (pins blocks) or an invalidation
            ready = [k for k in mgr.snapshot().keys]
            if ready and rng.random() < 0.3:
                key = rng.choice(ready)
                if mgr.peek([key]) == 1:
                    futures.append(mgr.load_many([key], [rng.randrange(32)]))
            if ready and rng.random() < 0.2:
                with contextlib.suppress(BlockStateError):  # a key with a copy in flight
                    mgr.invalidate([rng.choice(ready)])
            await mgr.step()
            for fut in futures:
                await fut
            # 3. the step's events, through vLLM's decoder, into the router's index
            events = mgr.take_events()
            if events:
                router.apply(encode_batch(fmt.batch(events)))
            ready_keys = {k for k in mgr.snapshot().keys if mgr.peek([k]) == 1}
            assert set(router.blocks) == {_low64(k) for k in ready_keys}, f"step {step}"
            for key in ready_keys:
                parent, tokens = router.blocks[_low64(key)]
                want = parent_of[key]
                assert parent == (None if want is None else _low64(want))
                assert tokens == _request_tokens(K.index(key))
    router.apply(encode_batch(fmt.batch(mgr.take_events())))
    assert router.blocks == {}
