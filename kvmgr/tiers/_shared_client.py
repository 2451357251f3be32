"""A ``SharedTier`` client's connection set-up, its own bookkeeping and warnings.

Private to ``kvmgr.tiers.shared``. Offers:
    open_calls          the connection options checked, then the server's address, the tier's
                        worker threads, counters and call ``Dispatcher``
    PutsInFlight        per key, the puts of this client still running; ``deleted`` marks those
                        a ``delete_many`` overtook (its ``UNLINK`` may reach the server before
                        their ``SET``), ``end`` says which keys a put that ended must delete again
    warn_default_user   the ``TierSecurityWarning`` about connecting as the ``default`` user

Only this client's puts are tracked: another instance's put of a deleted key (a shared tier
has many writers) stores it again, as any later put does. Every method runs on the event loop's
thread.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

from kvmgr.errors import ConfigError, TierSecurityWarning
from kvmgr.tiers._connection import ServerAddress, check_limits, endpoint_for, parse_address
from kvmgr.tiers._nodes import Breaker, SlotMap
from kvmgr.tiers._shared_calls import Dispatcher
from kvmgr.tiers.base import TierCounters

__all__ = ["PutsInFlight", "open_calls", "warn_default_user"]

_log = logging.getLogger("kvmgr.tiers.shared")

#: ``(username, password_file, password_env)``, as ``SharedTier`` takes them
Credentials = tuple[str | None, str | os.PathLike[str] | None, str | None]
#: ``(ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_check_hostname, connect_timeout_s)``
Reach = tuple[str | None, str | None, str | None, bool, float]
#: ``(reconnect_backoff_s, max_backoff_s, trip_after_timeouts)``: each server's ``Breaker``
#: (``max_backoff_s`` ``None``: ``DEFAULT_MAX_BACKOFF_S``, or the first backoff if longer)
Backoff = tuple[float, float | None, int]
DEFAULT_MAX_BACKOFF_S = 5.0


def open_calls(
    url: str, credentials: Credentials, reach: Reach, max_connections: int, backoff: Backoff
) -> tuple[ServerAddress, ThreadPoolExecutor, TierCounters, Dispatcher]:
    """Check the connection limits, resolve the address (password from the URL, the file or
    the environment), then build the worker threads (``max_connections``), the counters and
    the ``Dispatcher`` (one breaker per server; a slot map for a cluster). Connects to nothing.

    Raises:
        ConfigError: a non-positive limit, ``max_backoff_s`` below ``reconnect_backoff_s``,
            a bad URL, TLS arguments with a plain URL or unreadable TLS or password files;
            nothing was built then.
    """
    ca_certs, certfile, keyfile, check_hostname, connect_timeout_s = reach
    first_backoff, max_backoff, trips = backoff
    check_limits(
        connect_timeout_s=connect_timeout_s,
        reconnect_backoff_s=(first_backoff, True),
        max_backoff_s=(DEFAULT_MAX_BACKOFF_S if max_backoff is None else max_backoff, True),
        max_connections=(max_connections, int),
        trip_after_timeouts=(trips, int),
    )
    max_backoff = _backoff_cap(first_backoff, max_backoff)
    username, password_file, password_env = credentials
    address = parse_address(
        url, username=username, password_file=password_file, password_env=password_env
    )
    tls_files = (ca_certs, certfile, keyfile)
    endpoint = endpoint_for(address, tls_files, check_hostname, connect_timeout_s)
    executor = ThreadPoolExecutor(max_connections, thread_name_prefix="kvmgr-shared")
    counters = TierCounters("shared", "cluster" if address.is_cluster else "resp")
    breaker = functools.partial(Breaker, first_backoff, max_backoff, trips)
    slots = SlotMap(list(address.servers)) if address.is_cluster else None
    calls = Dispatcher(endpoint, breaker, max_connections, slots, executor, counters, address.url)
    return address, executor, counters, calls


def _backoff_cap(first_s: float, cap_s: float | None) -> float:
    """The breaker's backoff cap: ``cap_s``, or (``None``) ``DEFAULT_MAX_BACKOFF_S`` or
    ``first_s`` if that is longer.

    Raises:
        ConfigError: ``cap_s`` below ``first_s`` (the first period would win silently).
    """
    if cap_s is None:
        return max(DEFAULT_MAX_BACKOFF_S, first_s)
    if cap_s < first_s:
        raise ConfigError(
            f"SharedTier: max_backoff_s={cap_s!r} is below reconnect_backoff_s={first_s!r}: the "
            "cap of the breaker's backoff must be at least its first period (raise "
            "max_backoff_s, or leave it None)"
        )
    return cap_s


class PutsInFlight:
    """The running puts of one client, by key."""

    def __init__(self) -> None:
        self._puts: dict[bytes, set[int]] = {}  # key -> tokens of the puts writing it
        self._overtaken: set[tuple[int, bytes]] = set()  # (token, key) deleted meanwhile
        self._next = 0

    def begin(self, keys: list[bytes]) -> int:
        """A put of ``keys`` starts; returns its token (for ``end``)."""
        self._next += 1
        for key in keys:
            self._puts.setdefault(key, set()).add(self._next)
        return self._next

    def deleted(self, keys: list[bytes]) -> None:
        """A delete of ``keys`` starts: the puts of them running now are overtaken."""
        for key in keys:
            self._overtaken.update((token, key) for token in self._puts.get(key, ()))

    def end(self, token: int, keys: list[bytes]) -> list[bytes]:
        """The put ``token`` of ``keys`` ended; returns the keys a delete overtook (to delete
        again: the put may have stored them after the delete ran)."""
        late = []
        for key in keys:
            tokens = self._puts[key]
            tokens.discard(token)
            if not tokens:
                del self._puts[key]
            if (token, key) in self._overtaken:
                self._overtaken.discard((token, key))
                late.append(key)
        return late


def warn_default_user(url: str) -> None:
    """Log and warn (``TierSecurityWarning``) that ``url`` is used as the default user."""
    message = (
        f"SharedTier({url}): connecting as the server's default user; every client "
        "with its password can list, read and overwrite every tenant's keys. Use one ACL "
        "user per tenant (docs/tiers.md), or pass single_tenant=True if this server is "
        "yours alone."
    )
    _log.warning(message)
    warnings.warn(message, TierSecurityWarning, stacklevel=3)
