"""A ``SharedTier`` client's own bookkeeping and warnings.

Private to ``kvmgr.tiers.shared``. Offers:
    PutsInFlight        per key, the puts of this client still running; ``deleted`` marks those
                        a ``delete_many`` overtook (its ``UNLINK`` may reach the server before
                        their ``SET``), ``end`` says which keys a put that ended must delete again
    warn_default_user   the ``TierSecurityWarning`` about connecting as the ``default`` user

Only this client's puts are tracked: another instance's put of a deleted key (a shared tier
has many writers) stores it again, as any later put does. Every method runs on the event loop's
thread.
"""

from __future__ import annotations

import logging
import warnings

from kvmgr.errors import TierSecurityWarning

__all__ = ["PutsInFlight", "warn_default_user"]

_log = logging.getLogger("kvmgr.tiers.shared")


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
