"""Futures kvmgr hands out whose failure nobody may await (newuser12), and one future over
several swaps that ends only with all of them (newuser14).

``quiet(future)`` marks a future's exception retrieved once it is set, so asyncio does not log
"exception was never retrieved" for a swap the caller fired and forgot: the manager's own
swaps do the same in the flush (an unawaited failure is counted by ``statistics()``). A caller
that awaits the future still gets the exception.

``all_ended(futures)`` is what a call spanning several managers awaits: unlike
``asyncio.gather``, it neither fails at the first error while other copies still run nor
cancels the swaps' futures when it is cancelled, so its end means that no copy touches a block.
``fail_after(futures, error)`` is what such a call returns when a later swap refused after
earlier ones were queued (session 14): a future that fails with the refusal only once the
queued copies ended, so a caller that reuses its blocks after the future is done never has
them read or written by a copy it was told had failed. ``queue_all(calls)`` queues the swaps
of such a call in turn and returns the one future, either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from kvmgr.errors import KVMgrError

__all__ = ["all_ended", "fail_after", "queue_all", "quiet"]

F = TypeVar("F", bound="asyncio.Future[Any]")


def quiet(future: F) -> F:
    """``future``, its exception (when it gets one) marked retrieved; returns ``future``."""
    future.add_done_callback(_retrieve)
    return future


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def all_ended(futures: Sequence[asyncio.Future[Any]]) -> list[Any]:
    """The results of ``futures`` in order, once every one of them is done; then raises the
    first one's error, if any. Cancelling the caller leaves ``futures`` alone (shielded)."""
    done = await asyncio.gather(*(asyncio.shield(f) for f in futures), return_exceptions=True)
    for result in done:
        if isinstance(result, BaseException):
            raise result
    return done


async def fail_after(futures: Sequence[asyncio.Future[Any]], error: BaseException) -> Any:
    """Raise ``error`` once every one of ``futures`` is done (their results and errors are
    dropped: the call they belong to failed). Cancelling the caller leaves ``futures`` alone."""
    await asyncio.gather(*(asyncio.shield(f) for f in futures), return_exceptions=True)
    raise error


def queue_all(calls: Iterable[Callable[[], asyncio.Future[Any]]]) -> asyncio.Future[list[Any]]:
    """Make each call in turn (each queues one swap and returns its future): a ``quiet``
    future of their results that ends with every swap (``all_ended``). A call raising a
    ``KVMgrError`` after earlier ones queued makes it a future that fails with that error once
    the queued swaps ended (``fail_after``); one raising with nothing queued raises here."""
    futures: list[asyncio.Future[Any]] = []
    for call in calls:
        try:
            futures.append(call())
        except KVMgrError as error:
            if not futures:
                raise  # nothing queued: nothing changed
            return quiet(asyncio.ensure_future(fail_after(futures, error)))
    return quiet(asyncio.ensure_future(all_ended(futures)))
