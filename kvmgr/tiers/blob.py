"""The stored form of one block: its pages of every KV tensor in one blob, and the stored key.

Offers:
    TierNamespace    model + KV layout (page bytes per tensor, dtype names, block size) + tenant
                     salt; turns caller keys into stored keys, carries the layout fingerprint and
                     the tenant's sealing keys
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

Stored key: ``key_prefix + BLAKE2b-160(caller key, key = BLAKE2b(fingerprint, tenant salt))``.
BLAKE2b (``hashlib``) is keyed by the tenant's namespace: tenants with equal prompts get
unrelated stored keys, and without the salt nobody can compute a tenant's keys (so they cannot
probe whether a prefix is cached). Instances with another model or layout get another
fingerprint, hence other keys, and a blob whose fingerprint differs is never decoded.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterable, Sequence
from functools import cached_property
from typing import Any

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
HEADER_BYTES = _SUM_END + 16  # the MAC: bytes [48, 64)
_DIGEST_BYTES = 20
_NO_MAC = bytes(16)


def _positive_ints(
    _inst: object, attr: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]
) -> None:
    if not value or any(not _is_int(v) or v < 1 for v in value):
        raise ConfigError(f"{attr.name}: expected a non-empty tuple of ints >= 1, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _block_size(_inst: object, _attr: object, value: object) -> None:
    if not _is_int(value) or int(value) < 1:  # type: ignore[call-overload]
        raise ConfigError(f"block_size: expected an int >= 1, got {value!r}")


def _bytes_field(_inst: object, attr: attrs.Attribute[bytes], value: object) -> None:
    if not isinstance(value, bytes):
        shown = "a str (hidden)" if attr.name == "tenant_salt" else repr(value)
        raise ConfigError(
            f"{attr.name}: expected bytes (for example b'...' or 'text'.encode()), got {shown}"
        )


def _model(_inst: object, _attr: object, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"model: expected a non-empty str, got {value!r}")


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    try:
        return tuple(values)
    except TypeError:
        raise ConfigError(f"page_bytes: expected a tuple of ints, got {values!r}") from None


def _str_tuple(values: Iterable[str]) -> tuple[str, ...]:
    if isinstance(values, str):
        raise ConfigError(f"dtype_names: expected a tuple of names, got the str {values!r}")
    try:
        return tuple(values)
    except TypeError:
        raise ConfigError(f"dtype_names: expected a tuple of names, got {values!r}") from None


@attrs.frozen
class TierNamespace:
    """Who may read a block: model, KV layout and tenant, folded into every stored key.

    Attributes:
        model: model name (for example the Hugging Face id); part of the fingerprint.
        page_bytes: bytes of one page of each KV tensor, in tensor order.
        dtype_names: dtype of each KV tensor as its torch name (``"bfloat16"``,
            ``"float8_e4m3fn"``); one per tensor.
        block_size: tokens per block.
        tenant_salt: per-tenant secret (like vLLM's ``cache_salt``); ``b""`` = one tenant.
            Non-empty: stored keys are keyed by it and every blob is sealed (see the module
            docstring). Never logged or printed.
        key_prefix: readable prefix of every stored key (``SCAN MATCH kvmgr:*``).

    Raises:
        ConfigError: an empty model, empty or non-positive page sizes, dtype count differs from
            tensor count, block size not an int >= 1, or a salt/prefix that is not ``bytes``.
    """

    model: str = attrs.field(validator=_model)
    page_bytes: tuple[int, ...] = attrs.field(converter=_int_tuple, validator=_positive_ints)
    dtype_names: tuple[str, ...] = attrs.field(converter=_str_tuple)
    block_size: int = attrs.field(validator=_block_size)
    tenant_salt: bytes = attrs.field(default=b"", repr=False, validator=_bytes_field)
    key_prefix: bytes = attrs.field(default=b"kvmgr:", validator=_bytes_field)

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

    @property
    def is_sealed(self) -> bool:
        """Whether blobs carry a MAC (a tenant salt is set)."""
        return bool(self.tenant_salt)

    @cached_property
    def fingerprint(self) -> bytes:
        """16 bytes: BLAKE2b of model, page bytes, dtype names and block size (no salt)."""
        fields = [self.model, ",".join(map(str, self.page_bytes)), ",".join(self.dtype_names)]
        text = "\x1f".join([*fields, str(self.block_size)])
        return hashlib.blake2b(text.encode(), digest_size=16, person=b"kvmgr-layout").digest()

    @cached_property
    def _mac_key(self) -> bytes:
        return self._derive(b"kvmgr-tenant")

    @cached_property
    def _seal_key(self) -> bytes:
        return self._derive(b"kvmgr-seal")

    @cached_property
    def checksum_seed(self) -> int:
        """The XXH3 seed of this namespace's checksums: 0 unsealed, else a secret of the salt."""
        if not self.is_sealed:
            return 0
        return int.from_bytes(self._derive(b"kvmgr-seed")[:8], "little")

    def _derive(self, person: bytes) -> bytes:
        return hashlib.blake2b(
            self.fingerprint + self.tenant_salt, digest_size=32, person=person
        ).digest()

    def stored_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The stored key of each caller key (``key_prefix`` + 20 bytes); order kept."""
        mac_key, prefix = self._mac_key, self.key_prefix
        return [
            prefix + hashlib.blake2b(k, key=mac_key, digest_size=_DIGEST_BYTES).digest()
            for k in keys
        ]

    def _mac(self, head: bytes | memoryview, key: bytes) -> bytes:
        mac = hashlib.blake2b(head, key=self._seal_key, digest_size=16, person=b"kvmgr-mac")
        mac.update(key)
        return mac.digest()


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
        namespace._mac(view[:_SUM_END], stored_key) if namespace.is_sealed else _NO_MAC
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
        namespace._mac(view[:_SUM_END], stored_key), view[_SUM_END:HEADER_BYTES]
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
