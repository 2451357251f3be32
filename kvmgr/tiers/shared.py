"""The tier many serving instances share: blobs on a Valkey or Redis server, or a cluster of them.

Offers:
    SharedTier   ``TierBackend`` over RESP (``kvmgr.tiers._resp``), with the zero-copy read
                 ``get_into`` that ``TierBridge`` uses

One batch = one pipeline per server: ``GET`` per key, received straight into the caller's
buffers; ``EXISTS`` per key then ``SET key blob NX [PX ttl]`` for the keys the server lacks,
sent straight from the caller's buffers. Calls run in worker threads (one per server a batch
touches, at most ``max_connections`` at once); the event loop only waits. Eviction and TTL are
the server's (``maxmemory-policy allkeys-lru``, docs/tiers.md): a key the server dropped is a
miss.

Failure handling: every call has a deadline (``deadline_s``; ``hint_deadline_s`` for
``contains_many``, a lookup used as a hint). A call that waits for a free connection waits
within its deadline. Each server has a breaker: a refused connection, or ``trip_after_timeouts``
timeouts in a row (a frozen or black-holed server), makes later calls fail fast for
``reconnect_backoff_s`` (doubling up to ``max_backoff_s`` while it stays down); then one call
probes. A connection with any error is closed, so no late reply is ever read as the answer to a
later command. A cancelled call returns once its worker threads have let go of the buffers.

Cluster (``redis+cluster://`` URLs): the slot map comes from ``CLUSTER SLOTS``; a batch is split
by hash slot owner and pipelined per node, in parallel; ``MOVED`` updates the slot and retries
there, ``ASK`` retries once with ``ASKING``; a node that fails costs misses of its keys (its
breaker opens) until the cluster has failed over and a refresh finds the new primary.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvmgr.errors import InvalidKeyError, TierError
from kvmgr.tiers._connection import check_limits
from kvmgr.tiers._resp import nbytes
from kvmgr.tiers._shared_client import PutsInFlight, open_calls, warn_default_user
from kvmgr.tiers._shared_io import FAILED, get_part, keys_part, put_part
from kvmgr.tiers.base import Buffer, PutResult, TierStatistics, blob_views, check_keys

__all__ = ["SharedTier"]


class SharedTier:
    """Blobs on a Valkey/Redis server (or cluster), shared by every instance of a namespace.

    Args:
        url: ``redis://HOST:PORT/DB``, ``rediss://`` (TLS), ``valkey://``, ``valkeys://``,
            ``unix:///path.sock``, or ``redis+cluster://HOST:PORT[,HOST:PORT]`` (also
            ``rediss+cluster``, ``valkey+cluster``, ``valkeys+cluster``); may carry
            ``user:password@`` (prefer a file or env var). See docs/tiers.md.
        username: ACL user when the URL names none.
        password_file: file whose first line is the password (used when the URL has none).
        password_env: environment variable holding the password (used when neither has one).
        ttl_s: expire every stored key after this many seconds; ``None`` = the server's policy.
        deadline_s: deadline of every call (seconds), the wait for a free connection included.
        hint_deadline_s: deadline of ``contains_many`` (lookups are hints: a slow answer is
            worth less than a miss).
        connect_timeout_s: TCP/TLS connect timeout (seconds).
        max_connections: connections per server, and worker threads of this tier.
        reconnect_backoff_s: a breaker's first fail-fast period (seconds, may be 0).
        max_backoff_s: its cap (seconds), at least ``reconnect_backoff_s``; ``None``: 5 s, or
            ``reconnect_backoff_s`` if that is longer.
        trip_after_timeouts: consecutive timeouts that trip a server's breaker.
        ssl_ca_certs: CA bundle for TLS URLs (``None`` = the system store).
        ssl_certfile, ssl_keyfile: client certificate and key (mutual TLS).
        ssl_check_hostname: check the server certificate's name (verification is always on).
        single_tenant: the server holds one tenant's keys only; silences the warning about the
            ``default`` user (``kvmgr.errors.TierSecurityWarning``).
        skip_present: ``EXISTS`` before ``SET``: blobs the server holds are not sent again.

    Raises:
        ConfigError: a bad URL, TLS arguments with a plain URL or unreadable TLS files,
            non-positive limits, or ``max_backoff_s`` below ``reconnect_backoff_s``; nothing
            was built then.

    Warns:
        TierSecurityWarning: connecting as the server's ``default`` user (no ``username``)
            without ``single_tenant=True``: every client with that password can list, read and
            overwrite every key.
    """

    name = "shared"
    #: ``TierBridge`` reads tenancy from here: warn about an unsalted namespace unless set
    single_tenant: bool

    def __init__(
        self,
        url: str,
        *,
        username: str | None = None,
        password_file: str | os.PathLike[str] | None = None,
        password_env: str | None = "KVMGR_TIER_PASSWORD",
        ttl_s: float | None = None,
        deadline_s: float = 2.0,
        hint_deadline_s: float = 0.25,
        connect_timeout_s: float = 1.0,
        max_connections: int = 16,
        reconnect_backoff_s: float = 0.25,
        max_backoff_s: float | None = None,
        trip_after_timeouts: int = 2,
        ssl_ca_certs: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        ssl_check_hostname: bool = True,
        single_tenant: bool = False,
        skip_present: bool = True,
    ) -> None:
        check_limits(deadline_s=deadline_s, hint_deadline_s=hint_deadline_s, ttl_s=(ttl_s, None))
        self._address, self._executor, self._counters, self._calls = open_calls(
            url,
            (username, password_file, password_env),
            (ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_check_hostname, connect_timeout_s),
            max_connections,
            (reconnect_backoff_s, max_backoff_s, trip_after_timeouts),
        )
        self.single_tenant = single_tenant
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._deadline_s = deadline_s
        self._hint_deadline_s = hint_deadline_s
        self._skip_present = skip_present
        self._closed = False
        self._puts = PutsInFlight()  # a delete while a put runs deletes again when it ends
        if self._address.username is None and not single_tenant:
            warn_default_user(self.url)

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
        """Store the blobs (``SET .. NX``, after an ``EXISTS``), each sent from its own buffer;
        see ``TierBackend.put_many``. A key the server already holds counts as stored and is
        not sent again; its value and TTL (another writer's) are kept.

        Raises:
            InvalidKeyError: keys not distinct bytes, or one blob per key missing.
            InvalidArgumentError: a blob is not a C-contiguous buffer.
            TierTimeoutError, TierUnavailableError, TierFullError, TierError: no blob could
                be stored (with a cluster: on any node; otherwise ``stored`` says which).
        """
        keys = check_keys(keys, distinct=True)
        views = blob_views(blobs, len(keys))
        start = time.perf_counter()
        stored = np.zeros(len(keys), dtype=bool)
        num_bytes = 0
        token = self._puts.begin(keys)
        try:
            if keys:
                job = functools.partial(
                    put_part, blobs=views, ttl_ms=self._ttl_ms, skip_present=self._skip_present
                )
                outcome = await self._calls.run(keys, job, self._deadline_s, "put_many")
                for i, value in enumerate(outcome):
                    stored[i] = value is not FAILED
                    if value == "stored":
                        num_bytes += views[i].nbytes
                        self._counters.num_stored += 1
                    elif value == "present":
                        self._counters.num_already_present += 1
        finally:
            self._counters.add_put_time(time.perf_counter() - start)
            late = self._puts.end(token, keys)
            if late:  # a delete_many ran meanwhile: its UNLINK may have preceded our SET
                with contextlib.suppress(TierError):  # (as a delete_many that fails)
                    await self._unlink(late)
        self._counters.bytes_written += num_bytes
        return PutResult(stored, int(stored.sum()), num_bytes, time.perf_counter() - start)

    async def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """The stored values (``None`` where absent); see ``TierBackend.get_many``."""
        values = await self._get(check_keys(keys), None, None, None)
        return [v if isinstance(v, bytearray) else None for v in values]

    async def get_into(
        self,
        keys: Sequence[bytes],
        vectors: Sequence[Sequence[Any]],
        check: Callable[[int], bool] | None = None,
        blob_bytes: int | None = None,
    ) -> np.ndarray:
        """Receive the value of ``keys[i]`` straight into the buffers ``vectors[i]`` (it must be
        exactly their total length: ``blob_bytes`` for every vector when given), then
        ``check(i)`` in the worker; bool ``[n]`` hits. The buffers of a miss may have been
        written; none is touched after the await ends.

        Raises:
            InvalidKeyError: a key is not bytes, or one vector per key missing.
            TierTimeoutError, TierUnavailableError, TierError: the read failed everywhere.
        """
        keys = check_keys(keys)
        if len(vectors) != len(keys):
            raise InvalidKeyError(f"expected one vector per key, got {len(vectors)}")
        values = await self._get(keys, vectors, check, blob_bytes)
        return np.array([v is True for v in values], dtype=bool)

    async def contains_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """bool ``[n]`` from ``EXISTS`` per key, under ``hint_deadline_s``."""
        keys = check_keys(keys)
        if not keys:
            return np.zeros(0, dtype=bool)
        job = functools.partial(keys_part, verb=b"EXISTS")
        outcome = await self._calls.run(keys, job, self._hint_deadline_s, "contains_many")
        return np.array([isinstance(v, int) and v > 0 for v in outcome], dtype=bool)

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """``UNLINK`` the keys; returns how many existed. A put of them running in this client
        deletes them again when it ends (it counts them as stored; they read as misses)."""
        keys = check_keys(keys)
        self._puts.deleted(keys)
        return await self._unlink(keys)

    async def _unlink(self, keys: list[bytes]) -> int:
        if not keys:
            return 0
        job = functools.partial(keys_part, verb=b"UNLINK")
        outcome = await self._calls.run(keys, job, self._deadline_s, "delete_many")
        return sum(v for v in outcome if isinstance(v, int))

    async def aclose(self) -> None:
        """Wait for the worker threads (each ends by its deadline), close the connections;
        idempotent."""
        if self._closed:
            return
        self._closed = True
        self._calls.closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
        self._calls.close()

    def statistics(self) -> TierStatistics:
        """Totals since construction (``io_mode`` ``"resp"``, or ``"cluster"``)."""
        return self._counters.snapshot()

    # ---- internals ----------------------------------------------------------------------

    async def _get(
        self,
        keys: list[bytes],
        vectors: Sequence[Sequence[Any]] | None,
        check: Callable[[int], bool] | None,
        blob_bytes: int | None,
    ) -> list[Any]:
        start = time.perf_counter()
        try:
            if not keys:
                return []
            job = functools.partial(get_part, vectors=vectors, check=check, blob_bytes=blob_bytes)
            values = await self._calls.run(keys, job, self._deadline_s, "get_many")
        except TierError:
            self._counters.num_misses += len(keys)
            raise
        finally:
            self._counters.add_get_time(time.perf_counter() - start)
        for value in values:
            if value is True or isinstance(value, bytearray):
                self._counters.num_hits += 1
                self._counters.bytes_read += len(value) if isinstance(value, bytearray) else 0
            else:
                self._counters.num_misses += 1
                self._counters.num_corrupt += value is False
        if vectors is not None:
            hits = [i for i, v in enumerate(values) if v is True]
            self._counters.bytes_read += sum(sum(map(nbytes, vectors[i])) for i in hits)
        return values
