"""The testing guide's two engines, as presets of the one ``ScriptedEngine``.

Offers:
    FaultyEngine   ``ScriptedEngine`` over a real engine: fails, delays, hangs or holds chosen
                   batches, seeded
    NullEngine     ``ScriptedEngine`` without one: copies nothing; completes every batch at
                   once, or when the test says (``hold=True``)
    POISON_BYTE    what a failed store's CPU blocks are overwritten with
"""

from __future__ import annotations

from typing import Any

from kvmgr.errors import ConfigError
from kvmgr.testing.scripted import POISON_BYTE, ScriptedEngine
from kvmgr.transfer.engine import TransferEngine

__all__ = ["POISON_BYTE", "FaultyEngine", "NullEngine"]


class FaultyEngine(ScriptedEngine):
    """``ScriptedEngine(inner, ...)`` with ``inner`` required: every copy runs on ``inner``;
    the keyword arguments script the faults (``ScriptedEngine`` lists them).

    Raises:
        ConfigError: ``inner`` is not a ``TransferEngine``, or a bad script argument.
    """

    def __init__(self, inner: TransferEngine, **script: Any) -> None:
        if not isinstance(inner, TransferEngine):
            raise ConfigError(f"expected a TransferEngine, got {type(inner).__name__}")
        super().__init__(inner, **script)


class NullEngine(ScriptedEngine):
    """``ScriptedEngine(None, hold=hold, ...)``: for host-path benchmarks and for tests of the
    bookkeeping alone. Every batch completes inside ``submit`` (its future is resolved there),
    or, with ``hold=True``, only when ``complete_next`` or ``release`` says so (in submission
    order); ``close`` completes what it still holds. ``allocate_host`` returns an
    uninitialised CPU tensor (no page is touched).

    Raises:
        ConfigError: a bad script argument.
    """

    def __init__(self, *, hold: bool = False, **script: Any) -> None:
        super().__init__(None, hold=hold, **script)
