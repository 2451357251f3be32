"""kvmgr's KV events in vLLM's wire format, so that a consumer written for vLLM decodes them.

Offers:
    BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch
                        msgspec structs with the field names, order, tags and struct options of
                        vLLM's ``vllm.distributed.kv_events`` (checked against vLLM 0.33.0:
                        tests/events/test_events_vllm.py encodes the same content with vLLM's own
                        classes and compares the bytes)
    TierMedium          how one kvmgr tier is named in an event (medium, locality, ownership)
    VllmEventFormat     ``KVEvent`` -> those structs (block hashes, chains, token ids, group)
    encode_batch        a ``KVEventBatch`` as the msgpack bytes vLLM's ZMQ publisher sends

The wire shape (vLLM 0.33): a batch is a msgpack *array* ``[ts, events, data_parallel_rank]``;
each event is a msgpack *map* tagged ``"type": "BlockStored" | "BlockRemoved" |
"AllBlocksCleared"``, fields with a default omitted when they hold it. kvmgr never sets the
fields it has nothing for (``extra_keys``, ``session_id``, lookahead tokens), so they are
absent, as in vLLM's own events without them; they are declared all the same, because msgspec
sizes a map's header from the number of fields a struct declares (``BlockStored``'s 16 entries
take a map16 header, not a fixmap), and the bytes are to be vLLM's.

A ``stored`` event becomes one ``BlockStored`` per *chain run*: ``BlockStored.block_hashes``
must be a chain (each block extends the one before, the first extends ``parent_block_hash``),
while one kvmgr event covers every store of a batch, so it is cut wherever ``parents[i]`` is not
``keys[i - 1]``. Events without parents (promotions from a lower tier; a lower tier's own
events where published) become one ``BlockStored`` per key with no parent and no token ids,
like vLLM's placeholder events. Only the tiers listed in ``VllmEventFormat.media`` are
published (the CPU tier by default).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import msgspec

from kvmgr.errors import ConfigError
from kvmgr.reports import KVEvent

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "TierMedium",
    "VllmEventFormat",
    "encode_batch",
]

#: vLLM's ``ExternalBlockHash``: an int (its default) or the hash bytes.
BlockHash = int | bytes


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event structs (a map with a ``"type"`` field on the wire)."""


class BlockStored(_Event, tag="BlockStored"):
    """Blocks became readable in ``medium``; ``block_hashes`` is a chain whose first block
    extends ``parent_block_hash`` (``None``: a root). ``token_ids`` holds ``block_size``
    tokens per block (empty when unknown)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # never set by kvmgr
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None  # never set by kvmgr
    lookahead_token_ids: list[list[int]] | None = None  # never set by kvmgr


class BlockRemoved(_Event, tag="BlockRemoved"):
    """Blocks left ``medium`` (their hashes must no longer be routed to this instance)."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    """Everything this publisher advertised is gone."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: wall-clock ``ts`` (seconds since the epoch), events in order."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack bytes of ``batch`` (``msgspec.msgpack``, as vLLM's publisher encodes)."""
    return msgspec.msgpack.encode(batch)


@attrs.frozen(kw_only=True)
class TierMedium:
    """How a kvmgr tier appears in vLLM events.

    Attributes:
        medium: vLLM's medium string: ``"CPU"``, ``"STORAGE"`` (or ``"GPU"``).
        locality: ``"LOCAL"`` / ``"REMOTE"`` relative to this instance, or ``None``.
        ownership: the secondary tier's identifier, or ``None`` for the primary CPU tier.

    Raises:
        ConfigError: a field that is not a string (``locality``, ``ownership``: or ``None``).
    """

    medium: str
    locality: str | None = None
    ownership: str | None = None

    def __attrs_post_init__(self) -> None:
        _check_str("medium", self.medium, optional=False)
        _check_str("locality", self.locality)
        _check_str("ownership", self.ownership)


def _check_str(name: str, value: object, *, optional: bool = True) -> None:
    """Raises ConfigError: ``value`` is not a ``str`` (nor ``None`` where ``optional``); vLLM's
    decoder refuses a batch with such a field."""
    if not (isinstance(value, str) or (optional and value is None)):
        raise ConfigError(
            f"expected {name} to be a str{' or None' if optional else ''}, got {value!r}"
        )


def _default_media() -> dict[str, TierMedium]:
    return {"cpu": TierMedium(medium="CPU")}


@attrs.frozen(kw_only=True)
class VllmEventFormat:
    """Turns ``KVEvent``s into vLLM's event structs.

    Attributes:
        hash_format: ``"int"`` (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): a
            key's last 8 bytes read big-endian, i.e. the low 64 bits of the key as a big-endian
            integer, as vLLM converts its hash bytes; ``"bytes"``: the key as is.
        block_size: tokens per block, reported by events whose stores gave no token ids
            (``0``: unknown, vLLM's placeholder value). Events with token ids report theirs.
        group_idx: the KV cache group of every event (kvmgr has one key space per manager),
            or ``None`` to leave it out.
        kv_cache_spec_kind: vLLM's ``KVCacheSpecKind`` value of that group
            (``"full_attention"``, ``"mla_attention"``, ``"sliding_window"``, ...) or ``None``.
        sliding_window: the group's window in tokens, or ``None``.
        media: kvmgr tier name -> ``TierMedium``: the tiers whose events are published.
            Default: ``{"cpu": TierMedium(medium="CPU")}``. The events of a tier not listed are
            left out: lower tiers (disk, a shared Valkey) drop keys on their own (capacity,
            ``maxmemory``) and kvmgr hears of no such removal, so advertising their stores would
            leave a router routing to blocks that are gone. List one (``"disk":
            TierMedium(medium="STORAGE", ownership="disk")``) only where that is acceptable.

    Raises:
        ConfigError: an unknown ``hash_format``, a negative size or index, a
            ``kv_cache_spec_kind`` that is not a str or ``None``, or ``media`` not a mapping of
            tier names (str) to ``TierMedium``.
    """

    hash_format: str = attrs.field(default="int")
    block_size: int = attrs.field(default=0)
    group_idx: int | None = attrs.field(default=None)
    kv_cache_spec_kind: str | None = None
    sliding_window: int | None = attrs.field(default=None)
    media: Mapping[str, TierMedium] = attrs.field(factory=_default_media)

    def __attrs_post_init__(self) -> None:
        if self.hash_format not in ("int", "bytes"):
            raise ConfigError(f"expected hash_format 'int' or 'bytes', got {self.hash_format!r}")
        for name in ("block_size", "group_idx", "sliding_window"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ConfigError(f"expected {name} to be an int >= 0, got {value!r}")
        _check_str("kv_cache_spec_kind", self.kv_cache_spec_kind)
        media = self.media
        if not isinstance(media, Mapping) or not all(
            isinstance(tier, str) and isinstance(where, TierMedium) for tier, where in media.items()
        ):
            raise ConfigError(
                f"expected media to map tier names (str) to TierMedium, got {media!r:.80}"
            )

    def block_hash(self, key: bytes) -> BlockHash:
        """The ``ExternalBlockHash`` of a kvmgr key."""
        return int.from_bytes(key[-8:], "big") if self.hash_format == "int" else key

    def medium_of(self, tier: str) -> TierMedium | None:
        """The medium, locality and ownership of a kvmgr tier, or ``None``: not published."""
        return self.media.get(tier)

    def batch(
        self,
        events: Iterable[KVEvent],
        *,
        ts: float | None = None,
        data_parallel_rank: int | None = None,
    ) -> KVEventBatch:
        """One ``KVEventBatch`` of ``events`` in order (``ts``: now if ``None``)."""
        out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        for event in events:
            out.extend(self.convert(event))
        return KVEventBatch(time.time() if ts is None else ts, out, data_parallel_rank)

    def convert(self, event: KVEvent) -> Iterator[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The vLLM events of one ``KVEvent``.

        Raises:
            ValueError: an event kind kvmgr does not emit.
        """
        if event.kind == "cleared":
            yield AllBlocksCleared()
            return
        where = self.medium_of(event.tier)
        if where is None:  # a tier not published
            return
        if event.kind == "stored":
            yield from self._stored(event, where)
        elif event.kind == "removed":
            yield BlockRemoved(
                [self.block_hash(k) for k in event.keys],
                where.medium,
                self.group_idx,
                where.locality,
                where.ownership,
            )
        else:
            raise ValueError(f"unknown KV event kind {event.kind!r}")

    def _stored(self, event: KVEvent, where: TierMedium) -> Iterator[BlockStored]:
        keys, parents, tokens = event.keys, event.parents, event.token_ids
        block_size = self.block_size if tokens is None else int(tokens.shape[1])
        runs = _chain_runs(keys, parents) if parents is not None else _singles(len(keys))
        for start, end in runs:
            parent = None if parents is None else parents[start]
            yield BlockStored(
                [self.block_hash(k) for k in keys[start:end]],
                None if parent is None else self.block_hash(parent),
                [] if tokens is None else tokens[start:end].ravel().tolist(),
                block_size,
                None,
                where.medium,
                None,
                group_idx=self.group_idx,
                kv_cache_spec_kind=self.kv_cache_spec_kind,
                kv_cache_spec_sliding_window=self.sliding_window,
                locality=where.locality,
                ownership=where.ownership,
            )


def _chain_runs(
    keys: Sequence[bytes], parents: Sequence[bytes | None]
) -> Iterator[tuple[int, int]]:
    """Maximal ``[start, end)`` runs in which each key extends the one before it."""
    start = 0
    for i in range(1, len(keys)):
        if parents[i] != keys[i - 1]:
            yield start, i
            start = i
    if keys:
        yield start, len(keys)


def _singles(n: int) -> Iterator[tuple[int, int]]:
    return ((i, i + 1) for i in range(n))
