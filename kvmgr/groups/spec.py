"""Cache group specs and the grouped key space (no torch, no asyncio).

Offers:
    GroupKind         full attention, sliding window, recurrent state, MLA latent, compressed
    GroupSpec         one group: kind, block size (tokens), page bytes per tensor, window/ratio
    GroupedLayout     a model's groups over one hash block size; keys and restore spans
    offload_key       ``block_hash + group_id`` (``kvmgr.groups.keys``, re-exported)
    split_offload_key the inverse: ``(block_hash, group_id)``

A *cache group* is a set of KV tensors that share one block table (vLLM's ``KVCacheGroupSpec``).
Its kind says what a request that has computed ``N`` tokens still reads (``live_blocks``):

============== =========================================================================
kind           blocks a restore point at ``N`` tokens needs (block size ``B``)
============== =========================================================================
full, mla,     every block of the prefix: ``[0, N / B)``
compressed
sliding window the blocks holding the last ``W - 1`` past tokens: ``[(N - W + 1) // B, N / B)``
               (the next token attends to itself and ``W - 1`` earlier ones)
recurrent      the state at the boundary: block ``N / B - 1`` only (Mamba, linear attention:
               one state per block boundary)
============== =========================================================================

Keys: the caller hashes its prompt in blocks of ``hash_block_size`` tokens (chained hashes).
Block ``j`` of a group with block size ``B = m * hash_block_size`` is named by the hash of the
last hash block it covers, ``block_hashes[(j + 1) * m - 1]``, plus the group's 4-byte id:
``offload_key(h, group_id) == vllm.v1.kv_offload.base.make_offload_key(h, group_id)``, so the
keys and the KV events built from them interoperate with vLLM's.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvmgr.groups.errors import GroupKeyError, GroupSpecError
from kvmgr.groups.keys import GROUP_ID_BYTES, check_group_id, offload_key, split_offload_key

__all__ = [
    "GROUP_ID_BYTES",
    "GroupKind",
    "GroupSpec",
    "GroupedLayout",
    "offload_key",
    "split_offload_key",
]


class GroupKind(enum.Enum):
    """What a cache group holds, and so which of its blocks a restore point needs."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    RECURRENT = "recurrent"
    MLA = "mla"
    COMPRESSED = "compressed"

    @property
    def needs_prefix(self) -> bool:
        """True for the kinds whose restore point needs every block of the prefix."""
        return self in (GroupKind.FULL, GroupKind.MLA, GroupKind.COMPRESSED)


def _positive(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GroupSpecError(f"{what}: expected a positive int, got {value!r}")


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def _spec_tuple(values: Iterable[GroupSpec]) -> tuple[GroupSpec, ...]:
    return tuple(values)


def _kind(value: Any) -> GroupKind:
    try:
        return value if isinstance(value, GroupKind) else GroupKind(value)
    except ValueError:
        names = sorted(k.value for k in GroupKind)
        raise GroupSpecError(f"kind: expected one of {names}, got {value!r}") from None


@attrs.frozen(kw_only=True)
class GroupSpec:
    """One cache group.

    Attributes:
        name: unique within a layout (``"full"``, ``"swa"``, ``"mamba"``...).
        kind: a ``GroupKind`` (or its value, such as ``"sliding_window"``).
        block_size: tokens per block of this group (a multiple of the layout's hash block
            size). For a recurrent group, the token distance between stored states.
        page_bytes: bytes of one block in each of the group's tensors (one entry per tensor,
            for example per layer), ``sum(page_bytes)`` bytes per block in all.
        window: sliding window in tokens (``sliding_window`` only, >= 1).
        ratio: tokens per compressed entry (``compressed`` only, >= 2, dividing
            ``block_size``).
        group_id: the 4-byte group index of the keys (vLLM's KV cache group index); ``None``
            = the group's position in the layout.

    Raises:
        GroupSpecError: a field is invalid, or ``window``/``ratio`` given to the wrong kind.
    """

    name: str
    kind: GroupKind = attrs.field(converter=_kind)
    block_size: int
    page_bytes: tuple[int, ...] = attrs.field(converter=_int_tuple)
    window: int | None = None
    ratio: int | None = None
    group_id: int | None = None

    def _only_for(self, kind: GroupKind, field: str) -> bool:
        """Whether the group is of ``kind``; raises unless ``field`` is set exactly then."""
        value = getattr(self, field)
        if (self.kind is kind) != (value is not None):
            raise GroupSpecError(
                f"group {self.name!r}: {field} is required for {kind.value} groups and only "
                f"for them, got kind={self.kind.value} {field}={value!r}"
            )
        return self.kind is kind

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise GroupSpecError(f"name: expected a non-empty str, got {self.name!r}")
        _positive(f"group {self.name!r} block_size", self.block_size)
        if not self.page_bytes:
            raise GroupSpecError(f"group {self.name!r} page_bytes: expected at least one tensor")
        for b in self.page_bytes:
            _positive(f"group {self.name!r} page_bytes", b)
        sliding = self._only_for(GroupKind.SLIDING_WINDOW, "window")
        if sliding:
            _positive(f"group {self.name!r} window", self.window)
        if self._only_for(GroupKind.COMPRESSED, "ratio"):
            assert self.ratio is not None
            if isinstance(self.ratio, bool) or not isinstance(self.ratio, int) or self.ratio < 2:
                raise GroupSpecError(f"group {self.name!r} ratio: expected an int >= 2")
            if self.block_size % self.ratio:
                raise GroupSpecError(
                    f"group {self.name!r}: ratio {self.ratio} must divide block_size "
                    f"{self.block_size}"
                )
        if self.group_id is not None:
            try:
                check_group_id(self.group_id)
            except GroupKeyError as exc:
                raise GroupSpecError(f"group {self.name!r} group_id: {exc}") from None

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across the group's tensors."""
        return sum(self.page_bytes)

    def live_blocks(self, num_tokens: int) -> range:
        """Logical blocks a restore point at ``num_tokens`` needs (table in the module doc).

        Args:
            num_tokens: tokens computed; a multiple of ``block_size``.

        Raises:
            GroupKeyError: ``num_tokens`` is negative or not a multiple of ``block_size``.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise GroupKeyError(f"expected a token count >= 0, got {num_tokens!r}")
        if num_tokens % self.block_size:
            raise GroupKeyError(
                f"group {self.name!r}: {num_tokens} tokens is not a multiple of its block size "
                f"{self.block_size}"
            )
        end = num_tokens // self.block_size
        if self.kind.needs_prefix:
            return range(end)
        if self.kind is GroupKind.RECURRENT:
            return range(max(0, end - 1), end)
        assert self.window is not None
        return range(max(0, num_tokens - self.window + 1) // self.block_size, end)

    def reach_blocks(self) -> int | None:
        """How many blocks past block ``j`` a boundary that still needs ``j`` may lie: 0 for
        recurrent (only the boundary right after ``j``), about ``(W - 2) / B`` for a sliding
        window, ``None`` (unbounded) for the prefix kinds."""
        if self.kind.needs_prefix:
            return None
        if self.kind is GroupKind.RECURRENT:
            return 0
        assert self.window is not None
        return max(0, (self.window - 2) // self.block_size)


@attrs.frozen
class GroupedLayout:
    """A model's cache groups over one hash block size.

    Attributes:
        groups: the groups, in key order; names and (resolved) group ids unique.
        hash_block_size: tokens per caller block hash; divides every group's block size.
        boundary_tokens: the hit granularity, the lcm of the groups' block sizes: a restore
            point is a multiple of it, so that every group has whole blocks there.

    Raises:
        GroupSpecError: no groups, repeated names or ids, or a block size that is not a
            multiple of ``hash_block_size``.
    """

    groups: tuple[GroupSpec, ...] = attrs.field(converter=_spec_tuple)
    hash_block_size: int = 16
    boundary_tokens: int = attrs.field(init=False)
    _ids: tuple[int, ...] = attrs.field(init=False, repr=False)
    _by_name: dict[str, int] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if not self.groups or not all(isinstance(g, GroupSpec) for g in self.groups):
            raise GroupSpecError(f"expected one or more GroupSpec, got {self.groups!r:.80}")
        _positive("hash_block_size", self.hash_block_size)
        names = [g.name for g in self.groups]
        ids = [i if g.group_id is None else g.group_id for i, g in enumerate(self.groups)]
        if len(set(names)) != len(names):
            raise GroupSpecError(f"group names repeat: {names}")
        if len(set(ids)) != len(ids):
            raise GroupSpecError(f"group ids repeat: {ids}")
        for g in self.groups:
            if g.block_size % self.hash_block_size:
                raise GroupSpecError(
                    f"group {g.name!r}: block_size {g.block_size} is not a multiple of "
                    f"hash_block_size {self.hash_block_size}"
                )
        object.__setattr__(self, "boundary_tokens", math.lcm(*(g.block_size for g in self.groups)))
        object.__setattr__(self, "_ids", tuple(ids))
        object.__setattr__(self, "_by_name", {n: i for i, n in enumerate(names)})

    def index(self, name: str) -> int:
        """Position of group ``name``. Raises ``GroupKeyError`` for an unknown name."""
        try:
            return self._by_name[name]
        except (KeyError, TypeError):
            raise GroupKeyError(f"unknown group {name!r}; groups: {list(self._by_name)}") from None

    def group_id(self, index: int) -> int:
        """The 4-byte key id of the group at position ``index``."""
        return self._ids[index]

    def check_hashes(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """A copy of ``block_hashes`` checked to be non-empty ``bytes``.

        Raises:
            GroupKeyError: not a sequence of non-empty ``bytes``.
        """
        if isinstance(block_hashes, (bytes, str)) or not isinstance(block_hashes, Sequence):
            raise GroupKeyError(f"expected a sequence of bytes, got {type(block_hashes).__name__}")
        hashes = list(block_hashes)
        for i, h in enumerate(hashes):
            if not isinstance(h, bytes) or not h:
                raise GroupKeyError(f"block_hashes[{i}]: expected non-empty bytes, got {h!r:.60}")
        return hashes

    def num_blocks(self, index: int, num_hashes: int) -> int:
        """Full blocks of group ``index`` covered by ``num_hashes`` hash blocks."""
        return num_hashes * self.hash_block_size // self.groups[index].block_size

    def block_hash_index(self, index: int, block: int) -> int:
        """Position in the hash list of the hash naming logical block ``block`` of the group."""
        per_block = self.groups[index].block_size // self.hash_block_size
        return (block + 1) * per_block - 1

    def keys(
        self, index: int, hashes: Sequence[bytes], blocks: Sequence[int] | range
    ) -> list[bytes]:
        """Grouped keys of the logical ``blocks`` of group ``index`` (``hashes`` checked)."""
        gid = self._ids[index]
        suffix = gid.to_bytes(GROUP_ID_BYTES, "big", signed=False)
        return [hashes[self.block_hash_index(index, j)] + suffix for j in blocks]
