"""The tier many serving instances share: blobs on a Valkey or Redis server.

Offers:
    SharedTier   ``TierBackend`` over ``redis.asyncio`` (hiredis parser when installed)

One batch = one pipeline = one round trip per direction: writes are ``MSET`` (or ``SET .. PX``
with a TTL) in chunks of at most ``max_command_bytes``, reads ``MGET`` in chunks of
``max_keys_per_command``, all chunks in one pipeline. Eviction and TTL are the server's
(``maxmemory-policy allkeys-lru``, docs/tiers.md): a key the server dropped is a miss.

Failure handling: every call runs under ``deadline_s``; a cancelled command closes its
connection (redis-py discards a connection interrupted mid-reply), so no stale reply is ever
read. Connection errors retry once on a fresh connection (a restarted server), then raise
``TierUnavailableError`` and, for ``reconnect_backoff_s``, later calls fail fast without touching
the network; after that the pool reconnects by itself. Credentials never appear in ``repr``,
statistics, log records or error messages.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.credentials import UsernamePasswordCredentialProvider

from kvmgr.errors import (
    ConfigError,
    InvalidKeyError,
    TierError,
    TierFullError,
    TierTimeoutError,
    TierUnavailableError,
)
from kvmgr.tiers._connection import ServerAddress, parse_address
from kvmgr.tiers.base import (
    Buffer,
    PutResult,
    TierCounters,
    TierStatistics,
    check_keys,
    with_deadline,
)
from kvmgr.tiers.blob import verify

__all__ = ["SharedTier"]


class SharedTier:
    """Blobs on a Valkey/Redis server, shared by every instance that uses the same namespace.

    Args:
        url: ``redis://HOST:PORT/DB``, ``rediss://`` (TLS), ``valkey://``, ``valkeys://`` or
            ``unix:///path.sock``; may carry ``user:password@`` (prefer a file or env var).
        username: ACL user when the URL names none.
        password_file: file whose first line is the password (used when the URL has none).
        password_env: environment variable holding the password (used when neither has one).
        ttl_s: expire every stored key after this many seconds; ``None`` = the server's policy.
        deadline_s: deadline of every call (seconds).
        connect_timeout_s: TCP/TLS connect timeout (seconds).
        max_connections: connection pool size.
        max_command_bytes: split one batch's writes into commands of at most this many bytes
            (the server's ``proto-max-bulk-len``/query buffer limits); still one round trip.
        max_keys_per_command: keys per ``MGET``/``EXISTS`` chunk.
        reconnect_backoff_s: after a connection failure, fail fast for this long.
        ssl_ca_certs: CA bundle for ``rediss://`` (``None`` = system store).

    Raises:
        ConfigError: bad URL or non-positive limits.
    """

    name = "shared"

    def __init__(
        self,
        url: str,
        *,
        username: str | None = None,
        password_file: str | os.PathLike[str] | None = None,
        password_env: str | None = "KVMGR_TIER_PASSWORD",
        ttl_s: float | None = None,
        deadline_s: float = 2.0,
        connect_timeout_s: float = 1.0,
        max_connections: int = 16,
        max_command_bytes: int = 64 << 20,
        max_keys_per_command: int = 64,
        reconnect_backoff_s: float = 0.25,
        ssl_ca_certs: str | None = None,
    ) -> None:
        if min(deadline_s, connect_timeout_s, max_connections, max_command_bytes) <= 0:
            raise ConfigError("SharedTier: deadlines, pool size and command bytes must be > 0")
        if max_keys_per_command < 1 or (ttl_s is not None and ttl_s <= 0):
            raise ConfigError("SharedTier: expected max_keys_per_command >= 1 and ttl_s > 0")
        self._address: ServerAddress = parse_address(
            url, username=username, password_file=password_file, password_env=password_env
        )
        credentials = None
        if self._address.password is not None or self._address.username is not None:
            credentials = UsernamePasswordCredentialProvider(
                self._address.username,
                self._address.password.reveal() if self._address.password else None,
            )
        extra: dict[str, Any] = {}
        if self._address.is_tls and ssl_ca_certs is not None:
            extra["ssl_ca_certs"] = ssl_ca_certs
        self._client = aioredis.Redis.from_url(
            self._address.url,
            credential_provider=credentials,
            socket_timeout=deadline_s * 1.5,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 1),
            max_connections=max_connections,
            socket_read_size=1 << 20,  # blobs are 0.1-2 MiB: read them in few large chunks
            decode_responses=False,
            **extra,
        )
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._deadline_s = deadline_s
        self._max_command_bytes = max_command_bytes
        self._max_keys = max_keys_per_command
        self._backoff_s = reconnect_backoff_s
        self._down_until = 0.0
        self._counters = TierCounters(name="shared", io_mode="resp")
        self._closed = False

    def __repr__(self) -> str:
        user = f", user={self._address.username!r}" if self._address.username else ""
        auth = f", password from {self._address.password_source}" if self._address.password else ""
        return f"SharedTier({self._address.url!r}{user}{auth})"

    @property
    def url(self) -> str:
        """The server URL without credentials."""
        return self._address.url

    # ---- the protocol -------------------------------------------------------------------

    async def put_many(self, keys: Sequence[bytes], blobs: Sequence[Buffer]) -> PutResult:
        """Store the blobs, one pipeline; see ``TierBackend.put_many``."""
        keys = check_keys(keys, distinct=True)
        if len(blobs) != len(keys):
            raise InvalidKeyError(f"expected one blob per key, got {len(blobs)} for {len(keys)}")
        views = [memoryview(b).cast("B") for b in blobs]
        start = time.perf_counter()
        try:
            if keys:
                await self._call(self._put_pipeline(keys, views), "put_many")
        finally:
            self._counters.add_put_time(time.perf_counter() - start)
        num_bytes = sum(v.nbytes for v in views)
        self._counters.num_stored += len(keys)
        self._counters.bytes_written += num_bytes
        stored = np.ones(len(keys), dtype=bool)
        return PutResult(stored, len(keys), num_bytes, time.perf_counter() - start)

    async def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """Verified blobs, ``None`` where missing or corrupt; see ``TierBackend.get_many``."""
        keys = check_keys(keys)
        start = time.perf_counter()
        try:
            values = await self._call(self._get_pipeline(keys), "get_many") if keys else []
        except TierError:
            self._counters.num_misses += len(keys)
            raise
        finally:
            self._counters.add_get_time(time.perf_counter() - start)
        out: list[Buffer | None] = []
        for key, value in zip(keys, values):
            payload = None if value is None else verify(key, value)
            if payload is None:
                self._counters.num_misses += 1
                self._counters.num_corrupt += value is not None
                out.append(None)
            else:
                self._counters.num_hits += 1
                self._counters.bytes_read += len(value)
                out.append(value)
        return out

    async def contains_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """bool ``[n]`` from one pipeline of ``EXISTS``; see ``TierBackend.contains_many``."""
        keys = check_keys(keys)
        if not keys:
            return np.zeros(0, dtype=bool)

        async def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return await pipe.execute()

        return np.asarray(await self._call(run(), "contains_many"), dtype=np.int64) > 0

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """``UNLINK`` the keys; returns how many existed."""
        keys = check_keys(keys)
        if not keys:
            return 0
        return int(await self._call(self._client.unlink(*keys), "delete_many"))

    async def aclose(self) -> None:
        """Close the connection pool; idempotent."""
        if not self._closed:
            self._closed = True
            await self._client.aclose()

    def statistics(self) -> TierStatistics:
        """Totals since construction (``io_mode="resp"``)."""
        return self._counters.snapshot()

    # ---- internals ----------------------------------------------------------------------

    async def _put_pipeline(self, keys: list[bytes], views: list[memoryview]) -> None:
        pipe = self._client.pipeline(transaction=False)
        chunk: dict[bytes, memoryview] = {}
        chunk_bytes = 0
        for key, view in zip(keys, views):
            if self._ttl_ms is not None:
                pipe.set(key, view, px=self._ttl_ms)
                continue
            if chunk and chunk_bytes + view.nbytes > self._max_command_bytes:
                pipe.mset(chunk)
                chunk, chunk_bytes = {}, 0
            chunk[key] = view
            chunk_bytes += view.nbytes
        if chunk:
            pipe.mset(chunk)
        await pipe.execute()

    async def _get_pipeline(self, keys: list[bytes]) -> list[bytes | None]:
        pipe = self._client.pipeline(transaction=False)
        for i in range(0, len(keys), self._max_keys):
            pipe.mget(keys[i : i + self._max_keys])
        replies = await pipe.execute()
        return [value for reply in replies for value in reply]

    async def _call(self, awaitable: Any, what: str) -> Any:
        """Run one server call under the deadline; map every failure to a typed, counted error."""
        if self._closed:
            awaitable.close()
            raise TierUnavailableError(f"{what}: SharedTier is closed")
        if time.monotonic() < self._down_until:
            awaitable.close()
            self._counters.num_errors += 1
            raise TierUnavailableError(f"{what}: server {self.url} unreachable (backing off)")
        try:
            return await with_deadline(awaitable, self._deadline_s, f"{what} on {self.url}")
        except TierTimeoutError as exc:
            self._count(exc, "num_timeouts")
            raise
        except rexc.RedisError as exc:
            error, counter = self._classify(exc, what)
        except OSError as exc:
            error, counter = (
                TierUnavailableError(f"{what} on {self.url}: {type(exc).__name__}"),
                "num_errors",
            )
        self._count(error, counter)
        if isinstance(error, TierUnavailableError):
            self._down_until = time.monotonic() + self._backoff_s
        raise error

    def _classify(self, exc: rexc.RedisError, what: str) -> tuple[TierError, str]:
        """The typed error and the counter for a client error (messages carry no secrets)."""
        where = f"{what} on {self.url}"
        if isinstance(exc, rexc.TimeoutError):
            return TierTimeoutError(f"{where}: socket timeout"), "num_timeouts"
        if isinstance(exc, rexc.OutOfMemoryError):
            return TierFullError(f"{where}: server out of memory (maxmemory)"), "num_full"
        if isinstance(exc, rexc.AuthenticationError):
            return TierUnavailableError(f"{where}: authentication failed"), "num_errors"
        if isinstance(exc, rexc.ConnectionError):
            return TierUnavailableError(f"{where}: {type(exc).__name__}"), "num_errors"
        text = str(exc).split("\n")[0][:120]
        if text.startswith("OOM"):
            return TierFullError(f"{where}: {text}"), "num_full"
        return TierError(f"{where}: {type(exc).__name__}: {text}"), "num_errors"

    def _count(self, exc: TierError, counter: str) -> None:
        setattr(self._counters, counter, getattr(self._counters, counter) + 1)
        self._counters.last_error = str(exc)
