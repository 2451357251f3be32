"""Futures kvmgr hands out whose failure nobody may await (newuser12).

``quiet(future)`` marks a future's exception retrieved once it is set, so asyncio does not log
"exception was never retrieved" for a swap the caller fired and forgot: the manager's own
swaps do the same in the flush (an unawaited failure is counted by ``statistics()``). A caller
that awaits the future still gets the exception.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

__all__ = ["quiet"]

F = TypeVar("F", bound="asyncio.Future[Any]")


def quiet(future: F) -> F:
    """``future``, its exception (when it gets one) marked retrieved; returns ``future``."""
    future.add_done_callback(_retrieve)
    return future


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
