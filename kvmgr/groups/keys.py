"""The grouped key space: a block hash and a 4-byte group id, as vLLM's ``OffloadKey``.

Offers:
    GROUP_ID_BYTES      bytes of the group id at the end of every grouped key
    offload_key         ``block_hash + group_id`` as 4 big-endian bytes (vLLM's ``OffloadKey``)
    split_offload_key   the inverse: ``(block_hash, group_id)``
    check_group_id      refuse a group id outside ``[0, 2**32)``
"""

from __future__ import annotations

from kvmgr.groups.errors import GroupKeyError

__all__ = ["GROUP_ID_BYTES", "check_group_id", "offload_key", "split_offload_key"]

#: Bytes of the group id at the end of every grouped key (vLLM: 4, big-endian, unsigned).
GROUP_ID_BYTES = 4
_MAX_GROUP_ID = 2 ** (8 * GROUP_ID_BYTES) - 1


def offload_key(block_hash: bytes, group_id: int) -> bytes:
    """``block_hash`` followed by ``group_id`` as 4 big-endian bytes (vLLM ``make_offload_key``).

    Raises:
        GroupKeyError: ``block_hash`` is not non-empty bytes, or ``group_id`` is not in
            ``[0, 2**32)``.
    """
    if not isinstance(block_hash, bytes) or not block_hash:
        raise GroupKeyError(f"expected a non-empty bytes block hash, got {block_hash!r:.60}")
    check_group_id(group_id)
    return block_hash + group_id.to_bytes(GROUP_ID_BYTES, "big", signed=False)


def split_offload_key(key: bytes) -> tuple[bytes, int]:
    """``(block_hash, group_id)`` of a grouped key (vLLM ``get_offload_block_hash`` and
    ``get_offload_group_idx``).

    Raises:
        GroupKeyError: ``key`` is not bytes longer than the 4-byte group id.
    """
    if not isinstance(key, bytes) or len(key) <= GROUP_ID_BYTES:
        raise GroupKeyError(f"expected bytes longer than {GROUP_ID_BYTES}, got {key!r:.60}")
    return key[:-GROUP_ID_BYTES], int.from_bytes(key[-GROUP_ID_BYTES:], "big", signed=False)


def check_group_id(group_id: object) -> None:
    """Raise ``GroupKeyError`` unless ``group_id`` is an int in ``[0, 2**32)``."""
    if isinstance(group_id, bool) or not isinstance(group_id, int):
        raise GroupKeyError(f"expected an int group id, got {group_id!r}")
    if not 0 <= group_id <= _MAX_GROUP_ID:
        raise GroupKeyError(f"expected a group id in [0, {_MAX_GROUP_ID}], got {group_id}")
