"""The stored form of one block: its pages of every KV tensor in one blob, and the stored key.

Offers:
    TierNamespace    (from ``kvmgr.tiers.namespace``) model + layout + tenant: stored keys,
                     fingerprint, sealing keys
    HEADER_BYTES     bytes of the blob header (64)
    encode_rows      write headers into a ``[n, HEADER_BYTES + payload]`` array whose payload
                     columns are already filled
    encode_header    write one header for a payload given as several buffers (no gather)
    verify           check one stored value; returns its payload or ``None``
    verify_parts     the same for a header and a payload spread over several buffers
    blob_length      the blob length a header claims (for padded, aligned buffers)

Blob layout (little endian)::

    offset  size  field
    0       4     magic b"KVT1"
    4       2     format version (2)
    6       2     flags (bit 0: sealed, the MAC field is set)
    8       16    layout fingerprint (TierNamespace.fingerprint)
    24      8     payload bytes P
    32      16    XXH3-128 of bytes[0:32] + stored key + payload, seeded with the tenant's seed
    48      16    MAC: BLAKE2b-128 keyed with the tenant's MAC key over bytes[0:48] + stored key
                  (zeros when not sealed)
    64      P     payload: block's page of tensor 0, then tensor 1, ... (no padding)

The checksum binds the value to its stored key, so a value copied or moved under another key is
rejected like a corrupted or truncated one. It is xxHash's XXH3-128 (the ``xxhash`` package,
several GB/s per core): it detects accidents (bit rot, truncation, torn writes).

**Sealing (tenants).** A namespace with a tenant salt seals every blob: the checksum is seeded
with a 64-bit secret derived from the salt, and a keyed BLAKE2b MAC covers the header (checksum
included) and the stored key. Whoever can write to the server but lacks the tenant's salt can
neither compute a valid MAC nor predict the seeded checksum of a payload they chose, so a blob
they plant or alter is rejected (``verify`` returns ``None``) and never reaches a CPU block. The
payload itself is bound through the seeded XXH3, which is not a cryptographic hash: forging it
needs a collision of XXH3-128 under an unknown 64-bit seed. The server's ACLs stay the first
line (reading a tenant's KV needs read access to its keys; sealing does not encrypt).

A blob handed to a backend may be followed by padding up to an alignment the backend asks for
(``blob_alignment``, the disk tier's direct I/O); backends store and return only
``blob_length`` bytes.

The namespace (stored keys, fingerprint, the tenant's keys): ``kvmgr.tiers.namespace``.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

from kvmgr.tiers.namespace import HEADER_BYTES, TierNamespace

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "TierNamespace",
    "blob_length",
    "encode_header",
    "encode_rows",
    "verify",
    "verify_parts",
]

MAGIC = b"KVT1"
FORMAT_VERSION = 2
FLAG_SEALED = 1
_PREFIX = struct.Struct("<4sHH16sQ")  # magic, version, flags, fingerprint, payload bytes
_SUM_END = _PREFIX.size + 16  # the checksum: bytes [32, 48)
assert _SUM_END + 16 == HEADER_BYTES  # the MAC: bytes [48, 64)
_NO_MAC = bytes(16)


def _nbytes(buffer: Any) -> int:
    size = getattr(buffer, "nbytes", None)
    return memoryview(buffer).nbytes if size is None else int(size)


def _checksum(seed: int, prefix: Any, key: bytes, payload: Iterable[Any]) -> bytes:
    h = xxhash.xxh3_128(seed=seed)
    h.update(prefix)
    h.update(key)
    for part in payload:
        h.update(part)
    return h.digest()


def _prefix(namespace: TierNamespace, payload_bytes: int) -> bytes:
    flags = FLAG_SEALED if namespace.is_sealed else 0
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, flags, namespace.fingerprint, payload_bytes)


def encode_rows(rows: np.ndarray, stored_keys: Sequence[bytes], namespace: TierNamespace) -> None:
    """Fill the header of each row of ``rows`` in place (its payload columns already written).

    Args:
        rows: uint8 ``[n, HEADER_BYTES + P]``, each row contiguous (rows may be further apart, as
            in a slice of a padded, aligned buffer); ``rows[i, HEADER_BYTES:]`` is block
            ``i``'s payload. Columns ``[0, HEADER_BYTES)`` are overwritten.
        stored_keys: ``n`` stored keys (the checksum and the MAC bind each row to its key).
        namespace: the layout fingerprint and the tenant's sealing keys.
    """
    assert rows.dtype == np.uint8 and rows.ndim == 2 and rows.strides[1] == 1
    for i, key in enumerate(stored_keys):
        row = memoryview(rows[i])
        encode_header(row[:HEADER_BYTES], key, [row[HEADER_BYTES:]], namespace)


def encode_header(
    header: Any,
    stored_key: bytes,
    payload: Sequence[Any],
    namespace: TierNamespace,
    payload_bytes: int | None = None,
) -> None:
    """Write the ``HEADER_BYTES`` header of a blob whose payload is the concatenation of the
    buffers ``payload`` (a block's pages, read in place: no gather; ``payload_bytes`` long, when
    the caller knows it) into the writable buffer ``header`` (uint8, ``HEADER_BYTES`` long)."""
    view = memoryview(header).cast("B")
    size = sum(_nbytes(p) for p in payload) if payload_bytes is None else payload_bytes
    prefix = _prefix(namespace, size)
    view[: _PREFIX.size] = prefix
    view[_PREFIX.size : _SUM_END] = _checksum(namespace.checksum_seed, prefix, stored_key, payload)
    view[_SUM_END:HEADER_BYTES] = (
        namespace.seal(view[:_SUM_END], stored_key) if namespace.is_sealed else _NO_MAC
    )


def verify(stored_key: bytes, value: object, namespace: TierNamespace) -> memoryview | None:
    """The payload of ``value`` if it is an intact blob of ``namespace`` stored under
    ``stored_key``, else ``None``.

    ``None`` for: not a buffer, shorter than the header, wrong magic or version, a payload length
    that differs from the bytes present (truncated or extended), another layout's fingerprint, a
    checksum mismatch, or (sealed namespaces) a missing or wrong MAC.
    """
    try:
        view = memoryview(value).cast("B")  # type: ignore[arg-type]
    except TypeError:
        return None
    if view.nbytes < HEADER_BYTES:
        return None
    payload = view[HEADER_BYTES:]
    return payload if verify_parts(stored_key, view[:HEADER_BYTES], [payload], namespace) else None


def verify_parts(
    stored_key: bytes,
    header: Any,
    payload: Sequence[Any],
    namespace: TierNamespace,
    payload_bytes: int | None = None,
) -> bool:
    """Whether ``header`` (``HEADER_BYTES``) and the buffers ``payload`` (concatenated;
    ``payload_bytes`` long, when the caller knows it) form an intact blob of ``namespace`` under
    ``stored_key`` (the checks of ``verify``)."""
    view = memoryview(header).cast("B")
    if view.nbytes != HEADER_BYTES:
        return False
    magic, version, flags, found_fp, claimed = _PREFIX.unpack_from(view)
    if magic != MAGIC or version != FORMAT_VERSION or found_fp != namespace.fingerprint:
        return False
    if claimed != (sum(_nbytes(p) for p in payload) if payload_bytes is None else payload_bytes):
        return False
    if bool(flags & FLAG_SEALED) != namespace.is_sealed:
        return False  # an unsealed blob in a sealed namespace: planted without the key
    if namespace.is_sealed and not hmac.compare_digest(
        namespace.seal(view[:_SUM_END], stored_key), view[_SUM_END:HEADER_BYTES]
    ):
        return False
    found = _checksum(namespace.checksum_seed, view[: _PREFIX.size], stored_key, payload)
    return found == view[_PREFIX.size : _SUM_END]


def blob_length(value: object) -> int | None:
    """Bytes of the blob at the start of ``value`` per its header (``HEADER_BYTES + P``).

    For buffers that carry padding after the blob (aligned I/O). ``None`` when the header is not
    a blob header or claims more bytes than ``value`` has. Does not verify the checksum.
    """
    view = memoryview(value).cast("B")  # type: ignore[arg-type]
    if view.nbytes < HEADER_BYTES:
        return None
    magic, version, _flags, _fp, payload_bytes = _PREFIX.unpack_from(view)
    total = HEADER_BYTES + int(payload_bytes)
    if magic != MAGIC or version != FORMAT_VERSION or total > view.nbytes:
        return None
    return total
