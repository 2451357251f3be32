"""Servers of the shared tier: per-server connection pools and fail-fast breakers, and the slot
map of a Valkey/Redis Cluster (private to ``kvmgr.tiers``).

Offers:
    Breaker      fail fast after a refused connection or consecutive timeouts; one probe call
                 after a backoff that doubles while the server stays down
    NodePool     bounded connections to one server; a full pool is waited for (bounded by the
                 call's deadline), never reported as "server down"
    PoolWaitTimeout   the deadline passed while waiting for a free connection (not the server's
                 fault: a breaker never counts it)
    SlotMap      hash slot -> primary from ``CLUSTER SLOTS``; ``MOVED`` updates one slot at once
                 and schedules a full refresh

Thread safety: pools and breakers are used from the shared tier's worker threads and from the
event loop thread; each guards its state with a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
from redis.crc import key_slot

from kvmgr.errors import TierError, TierTimeoutError, TierUnavailableError
from kvmgr.tiers._resp import Endpoint, ReplyError, command
from kvmgr.tiers._resp_conn import Connection
from kvmgr.tiers._resp_connect import connect

__all__ = ["NUM_SLOTS", "Breaker", "NodePool", "PoolWaitTimeout", "SlotMap"]

NUM_SLOTS = 16384


class PoolWaitTimeout(TierTimeoutError):
    """No connection of the pool came free before the call's deadline (the server is healthy)."""


class Breaker:
    """Fail-fast state of one server.

    Closed: calls go through. A connection failure, or ``trip_after`` timeouts in a row, opens
    it for ``backoff_s`` (doubling up to ``max_backoff_s`` while the server stays down): calls
    fail fast without touching the network. After the backoff one call goes through as a probe
    (the others still fail fast); its success closes the breaker, its failure opens it again.
    """

    def __init__(self, backoff_s: float, max_backoff_s: float, trip_after: int) -> None:
        self._lock = threading.Lock()
        self._base_s = backoff_s
        self._max_s = max(backoff_s, max_backoff_s)
        self._trip_after = trip_after
        self._backoff_s = backoff_s
        self._open_until: float | None = None
        self._probing = False
        self._timeouts = 0

    @property
    def is_open(self) -> bool:
        """Tripped (failing fast, or waiting for its probe)."""
        return self._open_until is not None

    def admit(self) -> bool:
        """Whether a call may touch the network now (``False``: fail fast)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or time.monotonic() < self._open_until:
                return False
            self._probing = True
            return True

    def succeeded(self) -> None:
        """A call got its replies: close."""
        with self._lock:
            self._open_until = None
            self._probing = False
            self._timeouts = 0
            self._backoff_s = self._base_s

    def failed(self, error: TierError) -> None:
        """A call failed with ``error``; pool waits and server error replies do not count."""
        if isinstance(error, PoolWaitTimeout) or not isinstance(
            error, TierTimeoutError | TierUnavailableError
        ):
            return
        with self._lock:
            if isinstance(error, TierTimeoutError):
                self._timeouts += 1
                if self._timeouts < self._trip_after and not self._probing:
                    return
            if self._open_until is not None and not self._probing:
                return  # already open (a call admitted before the trip)
            self._open_until = time.monotonic() + self._backoff_s
            self._backoff_s = min(self._max_s, max(2 * self._backoff_s, 1e-3))
            self._probing = False
            self._timeouts = 0


class NodePool:
    """At most ``max_connections`` connections to one server, reused last-in first-out.

    ``acquire`` waits for a free connection until the call's deadline (``PoolWaitTimeout``
    then); a connection that failed is closed on ``release``, never reused.
    """

    def __init__(self, endpoint: Endpoint, max_connections: int, breaker: Breaker) -> None:
        self.endpoint = endpoint
        self.breaker = breaker
        self._slots = threading.BoundedSemaphore(max_connections)
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, deadline: float) -> tuple[Connection, bool]:
        """A connection and whether it was reused (an idle one may have gone stale).

        Raises:
            PoolWaitTimeout: no connection came free before ``deadline``.
            TierTimeoutError, TierUnavailableError: a new connection could not be made.
        """
        left = deadline - time.monotonic()
        if left <= 0 or not self._slots.acquire(timeout=left):
            raise PoolWaitTimeout(
                f"server {self.endpoint.address}: every connection busy until the deadline"
            )
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is not None:
            return conn, True
        try:
            return connect(self.endpoint, deadline), False
        except BaseException:
            self._slots.release()
            raise

    def release(self, conn: Connection) -> None:
        """Give ``conn`` back (closed instead when broken or the pool is closed)."""
        with self._lock:
            if conn.broken or self._closed:
                conn.close()
            else:
                self._idle.append(conn)
        self._slots.release()

    def close(self) -> None:
        """Close the idle connections; those in use close when released."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class SlotMap:
    """Which primary serves each of the 16384 hash slots of a cluster.

    ``refresh`` asks one reachable node for ``CLUSTER SLOTS``; ``moved`` records a ``MOVED``
    redirection for its slot at once (and marks the map for a full refresh); ``owner`` gives a
    key's primary as ``(host, port)``.
    """

    def __init__(self, seeds: list[tuple[str, int]]) -> None:
        self._lock = threading.Lock()
        self.seeds = list(seeds)
        self.nodes: list[tuple[str, int]] = []
        self._owner = np.full(NUM_SLOTS, -1, dtype=np.int32)
        self.stale = True
        self.refreshed_at = 0.0

    def owners(self, keys: list[bytes]) -> list[tuple[str, int] | None]:
        """The primary of each key (``None``: its slot has no known owner)."""
        with self._lock:
            nodes, owner = self.nodes, self._owner
            out: list[tuple[str, int] | None] = []
            for key in keys:
                index = int(owner[key_slot(key)])
                out.append(nodes[index] if index >= 0 else None)
            return out

    def moved(self, slot: int, address: tuple[str, int]) -> None:
        """A ``MOVED slot host:port`` reply: that slot's primary is ``address``."""
        with self._lock:
            if address not in self.nodes:
                self.nodes = [*self.nodes, address]
            self._owner[slot] = self.nodes.index(address)
            self.stale = True

    def refresh(self, pool_of: Callable[[tuple[str, int]], NodePool], deadline: float) -> bool:
        """Read ``CLUSTER SLOTS`` from the first node that answers (known primaries first, then
        the seeds); returns whether the map was updated. Nodes whose breaker is open are tried
        last."""
        with self._lock:
            candidates = list(dict.fromkeys([*self.nodes, *self.seeds]))
        candidates.sort(key=lambda a: pool_of(a).breaker.is_open)
        for address in candidates:
            pool = pool_of(address)
            try:
                conn, _reused = pool.acquire(deadline)
            except TierError:
                continue
            try:
                conn.send(command(b"CLUSTER", b"SLOTS"), deadline)
                reply = conn.read_reply(deadline)
            except TierError:
                continue
            finally:
                pool.release(conn)
            if isinstance(reply, list) and reply:
                self._apply(reply, address[0])
                return True
        return False

    def _apply(self, reply: list[object], asked_host: str) -> None:
        nodes: list[tuple[str, int]] = []
        owner = np.full(NUM_SLOTS, -1, dtype=np.int32)
        for entry in reply:
            if not isinstance(entry, list) or len(entry) < 3 or not isinstance(entry[2], list):
                continue
            start, end, primary = entry[0], entry[1], entry[2]
            host = bytes(primary[0]).decode() or asked_host  # "" = the node that answered
            address = (host, int(primary[1]))
            if address not in nodes:
                nodes.append(address)
            owner[int(start) : int(end) + 1] = nodes.index(address)
        with self._lock:
            self.nodes, self._owner = nodes, owner
            self.stale = False
            self.refreshed_at = time.monotonic()


def parse_redirect(reply: ReplyError) -> tuple[int, tuple[str, int]] | None:
    """``(slot, (host, port))`` of a ``MOVED``/``ASK`` reply, else ``None``."""
    parts = reply.text.split(" ")
    if reply.kind not in ("MOVED", "ASK") or len(parts) < 3:
        return None
    host, _, port = parts[2].rpartition(":")
    try:
        return int(parts[1]), (host.strip("[]"), int(port))
    except ValueError:
        return None
