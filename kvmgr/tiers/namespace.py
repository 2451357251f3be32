"""Who may read a block: model, KV layout and tenant, folded into every stored key.

Offers:
    TierNamespace    model + KV layout (page bytes per tensor, dtype names, block size) + tenant
                     salt; turns caller keys into stored keys, carries the layout fingerprint and
                     the tenant's sealing keys (``kvmgr.tiers.blob`` encodes and verifies blobs
                     with them)
    HEADER_BYTES     bytes of a blob's header (64; its layout: ``kvmgr.tiers.blob``)

Stored key: ``key_prefix + BLAKE2b-160(caller key, key = BLAKE2b(fingerprint, tenant salt))``.
BLAKE2b (``hashlib``) is keyed by the tenant's namespace: tenants with equal prompts get
unrelated stored keys, and without the salt nobody can compute a tenant's keys (so they cannot
probe whether a prefix is cached). Instances with another model or layout get another
fingerprint, hence other keys, and a blob whose fingerprint differs is never decoded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from functools import cached_property

import attrs
import numpy as np

from kvmgr.errors import ConfigError

__all__ = ["HEADER_BYTES", "TierNamespace"]

#: Bytes of a blob's header: magic, version, flags, fingerprint, payload bytes (32), the
#: checksum (16) and the MAC (16).
HEADER_BYTES = 64
_DIGEST_BYTES = 20


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

    def seal(self, head: bytes | memoryview, key: bytes) -> bytes:
        """The 16-byte MAC of a blob header ``head`` under ``key`` (sealed namespaces)."""
        mac = hashlib.blake2b(head, key=self._seal_key, digest_size=16, person=b"kvmgr-mac")
        mac.update(key)
        return mac.digest()
