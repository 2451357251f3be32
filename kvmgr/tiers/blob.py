"""The stored form of one block: its pages of every KV tensor in one blob, and the stored key.

Offers:
    TierNamespace    model + KV layout (page bytes per tensor, dtype names, block size) + tenant
                     salt; turns caller keys into stored keys and carries the layout fingerprint
    HEADER_BYTES     bytes of the blob header (48)
    encode_rows      write headers and checksums into a ``[n, HEADER_BYTES + payload]`` array
                     whose payload columns are already filled
    verify           check one stored value; returns its payload or ``None``

Blob layout (little endian)::

    offset  size  field
    0       4     magic b"KVT1"
    4       2     format version (1)
    6       2     flags (0)
    8       16    layout fingerprint (TierNamespace.fingerprint)
    24      8     payload bytes P
    32      16    xxh3_128 of bytes[0:32] + stored key + payload
    48      P     payload: block's page of tensor 0, then tensor 1, ... (no padding)

The checksum binds the value to its stored key, so a value copied or moved under another key is
rejected like a corrupted or truncated one. It is xxHash's XXH3-128 (the ``xxhash`` package),
~30 GB/s: it detects accidents (bit rot, truncation, torn writes), not an adversary with write
access to the store; the trust boundary is the server's ACLs (docs/tiers.md).

A blob handed to a backend may be followed by padding up to an alignment the backend asks for
(``blob_alignment``, the disk tier's direct I/O); backends store and return only
``blob_length`` bytes.

Stored key: ``key_prefix + BLAKE2b-160(caller key, key = BLAKE2b(fingerprint, tenant salt))``.
BLAKE2b (``hashlib``) is keyed by the tenant's namespace: tenants with equal prompts get
unrelated stored keys, and without the salt nobody can compute a tenant's keys (so they cannot
probe whether a prefix is cached). Instances with another model or layout get another
fingerprint, hence other keys, and a blob whose fingerprint differs is never decoded.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from functools import cached_property

import attrs
import numpy as np
import xxhash

from kvmgr.errors import ConfigError

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "TierNamespace",
    "blob_length",
    "encode_rows",
    "verify",
]

MAGIC = b"KVT1"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHH16sQ")  # magic, version, flags, fingerprint, payload bytes
HEADER_BYTES = _PREFIX.size + 16
_DIGEST_BYTES = 20


def _positive_ints(
    _inst: object, attr: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]
) -> None:
    if not value or any(not isinstance(v, int) or v < 1 for v in value):
        raise ConfigError(f"{attr.name}: expected a non-empty tuple of ints >= 1, got {value!r}")


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def _str_tuple(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


@attrs.frozen
class TierNamespace:
    """Who may read a block: model, KV layout and tenant, folded into every stored key.

    Attributes:
        model: model name (for example the Hugging Face id); part of the fingerprint.
        page_bytes: bytes of one page of each KV tensor, in tensor order.
        dtype_names: dtype of each KV tensor as its torch name (``"bfloat16"``,
            ``"float8_e4m3fn"``); one per tensor.
        block_size: tokens per block.
        tenant_salt: per-tenant secret-ish salt (like vLLM's ``cache_salt``); ``b""`` = one
            tenant. Never logged.
        key_prefix: readable prefix of every stored key (``SCAN MATCH kvmgr:*``).

    Raises:
        ConfigError: empty or non-positive page sizes, dtype count differs from tensor count,
            block size < 1, or a salt/prefix that is not bytes.
    """

    model: str
    page_bytes: tuple[int, ...] = attrs.field(converter=_int_tuple, validator=_positive_ints)
    dtype_names: tuple[str, ...] = attrs.field(converter=_str_tuple)
    block_size: int = attrs.field(validator=attrs.validators.gt(0))
    tenant_salt: bytes = attrs.field(
        default=b"", repr=False, validator=attrs.validators.instance_of(bytes)
    )
    key_prefix: bytes = attrs.field(
        default=b"kvmgr:", validator=attrs.validators.instance_of(bytes)
    )

    @dtype_names.validator
    def _check_dtypes(self, _attr: object, value: tuple[str, ...]) -> None:
        if len(value) != len(self.page_bytes) or not all(isinstance(v, str) for v in value):
            raise ConfigError(
                f"dtype_names: expected {len(self.page_bytes)} names (one per tensor), got {value!r}"
            )

    @property
    def payload_bytes(self) -> int:
        """Bytes of one block's pages across all tensors (the blob payload)."""
        return sum(self.page_bytes)

    @property
    def blob_bytes(self) -> int:
        """Bytes of one encoded blob: ``HEADER_BYTES + payload_bytes``."""
        return HEADER_BYTES + self.payload_bytes

    @cached_property
    def fingerprint(self) -> bytes:
        """16 bytes: BLAKE2b of model, page bytes, dtype names and block size (no salt)."""
        fields = [self.model, ",".join(map(str, self.page_bytes)), ",".join(self.dtype_names)]
        text = "\x1f".join([*fields, str(self.block_size)])
        return hashlib.blake2b(text.encode(), digest_size=16, person=b"kvmgr-layout").digest()

    @cached_property
    def _mac_key(self) -> bytes:
        return hashlib.blake2b(
            self.fingerprint + self.tenant_salt, digest_size=32, person=b"kvmgr-tenant"
        ).digest()

    def stored_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The stored key of each caller key (``key_prefix`` + 20 bytes); order kept."""
        mac_key, prefix = self._mac_key, self.key_prefix
        return [
            prefix + hashlib.blake2b(k, key=mac_key, digest_size=_DIGEST_BYTES).digest()
            for k in keys
        ]


def _checksum(prefix: memoryview | bytes, key: bytes, payload: memoryview) -> bytes:
    h = xxhash.xxh3_128()
    h.update(prefix)
    h.update(key)
    h.update(payload)
    return h.digest()


def encode_rows(rows: np.ndarray, stored_keys: Sequence[bytes], fingerprint: bytes) -> None:
    """Fill the header of each row of ``rows`` in place (its payload columns already written).

    Args:
        rows: uint8 ``[n, HEADER_BYTES + P]``, each row contiguous (rows may be further apart, as
            in a slice of a padded, aligned buffer); ``rows[i, HEADER_BYTES:]`` is block
            ``i``'s payload. Columns ``[0, HEADER_BYTES)`` are overwritten.
        stored_keys: ``n`` stored keys (the checksum binds each row to its key).
        fingerprint: 16-byte layout fingerprint.
    """
    assert rows.dtype == np.uint8 and rows.ndim == 2 and rows.strides[1] == 1
    payload_bytes = rows.shape[1] - HEADER_BYTES
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, fingerprint, payload_bytes)
    rows[:, : _PREFIX.size] = np.frombuffer(prefix, np.uint8)
    for i, key in enumerate(stored_keys):
        row = memoryview(rows[i])
        row[_PREFIX.size : HEADER_BYTES] = _checksum(prefix, key, row[HEADER_BYTES:])


def verify(
    stored_key: bytes,
    value: object,
    fingerprint: bytes | None = None,
    *,
    checksum: bool = True,
) -> memoryview | None:
    """The payload of ``value`` if it is an intact blob stored under ``stored_key``, else ``None``.

    ``None`` for: not a buffer, shorter than the header, wrong magic or version, a payload length
    that differs from the bytes present (truncated or extended), a checksum mismatch, or (when
    ``fingerprint`` is given) another layout's fingerprint. ``checksum=False`` checks the header
    only (for a blob a backend has already verified).
    """
    try:
        view = memoryview(value).cast("B")  # type: ignore[arg-type]
    except TypeError:
        return None
    if view.nbytes < HEADER_BYTES:
        return None
    magic, version, _flags, found_fp, payload_bytes = _PREFIX.unpack_from(view)
    if magic != MAGIC or version != FORMAT_VERSION or payload_bytes != view.nbytes - HEADER_BYTES:
        return None
    if fingerprint is not None and found_fp != fingerprint:
        return None
    payload = view[HEADER_BYTES:]
    if (
        checksum
        and _checksum(view[: _PREFIX.size], stored_key, payload)
        != view[_PREFIX.size : HEADER_BYTES]
    ):
        return None
    return payload


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
