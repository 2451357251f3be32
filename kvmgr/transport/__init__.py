"""Transports between the scheduler side and the per-rank transfer workers.

Offers:
    LocalTransport   one rank in process: plain calls, no serialization, no thread hop of its own
    RankGroup        one process per rank (spawned), each serving its ``TransferWorker``
    RankTransport    scheduler <-> a group's ranks: msgspec frames over Unix pipes, read on the
                     event loop; jobs complete when every rank succeeded
    check_layouts    refuse ranks whose KV layouts differ (``LayoutMismatchError``)

``rank.serve_rank`` is each rank process's main function; ``frames`` the wire format.
"""

from __future__ import annotations

from kvmgr.transport.group import RankGroup, RankTransport, check_layouts
from kvmgr.transport.local import LocalTransport

__all__ = ["LocalTransport", "RankGroup", "RankTransport", "check_layouts"]
