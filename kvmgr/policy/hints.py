"""Hints from the serving loop about the blocks of a store.

Offers `StoreHint`, taken by ``OffloadManager.swap_out(..., hint=)`` and
``store_many(..., hints=)`` and handed to a policy whose ``takes_hints`` is true (``"online"``)
as ``admit(keys, parents, hints=...)``; `hints_per_key` spreads the caller's argument over the
keys of a call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from kvmgr.errors import InvalidArgumentError

__all__ = ["StoreHint", "hints_per_key"]


def _check_p(instance: object, attribute: attrs.Attribute[float | None], value: object) -> None:
    if value is not None and not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise InvalidArgumentError(f"StoreHint.continue_p: expected [0, 1] or None, got {value!r}")


def _check_ttl(instance: object, attribute: attrs.Attribute[float | None], value: object) -> None:
    if value is not None and not (
        isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
    ):
        raise InvalidArgumentError(f"StoreHint.ttl_s: expected > 0 seconds or None, got {value!r}")


def _check_session(instance: object, attribute: attrs.Attribute[object], value: object) -> None:
    try:
        hash(value)
    except TypeError:
        raise InvalidArgumentError(
            f"StoreHint.session: expected a hashable id, got {type(value).__name__}"
        ) from None


@attrs.frozen(slots=True)
class StoreHint:
    """What the serving loop knows about the request whose blocks it stores.

    Every field is optional; a policy that takes hints learns online how far to trust
    ``continue_p`` (it is one feature of its predictor), so a poor hint costs little.

    Attributes:
        session: conversation or user id (any hashable, compared by equality); a later store of
            the same session counts as a reuse of the session's previous blocks.
        continue_p: probability in [0, 1] that the conversation continues soon (its blocks are
            looked up again), from the application (for example an LPC-style predictor).
        priority: > 0: always store (while room can be made); < 0: never store while the
            tier is full; 0: no preference.
        ttl_s: seconds after which the blocks are worth nothing (they are evicted first then).

    Raises:
        InvalidArgumentError: an unhashable ``session``, ``continue_p`` outside [0, 1],
            ``ttl_s`` not > 0, or a non-int ``priority``.
    """

    session: object = attrs.field(default=None, validator=_check_session)
    continue_p: float | None = attrs.field(default=None, validator=_check_p)
    priority: int = attrs.field(default=0)
    ttl_s: float | None = attrs.field(default=None, validator=_check_ttl)

    @priority.validator
    def _check_priority(self, attribute: attrs.Attribute[int], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"StoreHint.priority: expected an int, got {value!r}")


def hints_per_key(hints: object, n: int) -> list[StoreHint | None] | None:
    """One hint (or ``None``) per key of a call of ``n`` keys.

    Args:
        hints: ``None``; one `StoreHint` for every key; or a sequence of ``n`` entries, each a
            `StoreHint` or ``None``.

    Raises:
        InvalidArgumentError: a sequence of the wrong length, or an entry of another type.
    """
    if hints is None:
        return None
    if isinstance(hints, StoreHint):
        return [hints] * n
    if not isinstance(hints, Sequence) or isinstance(hints, (str, bytes)):
        raise InvalidArgumentError(
            f"hints: expected a StoreHint or a sequence of them, got {type(hints).__name__}"
        )
    if len(hints) != n:
        raise InvalidArgumentError(f"hints: expected {n} entries (one per key), got {len(hints)}")
    for h in hints:
        if h is not None and not isinstance(h, StoreHint):
            raise InvalidArgumentError(f"hints: expected StoreHint or None, got {type(h).__name__}")
    return list(hints)
