"""Transports between the scheduler side and the per-rank transfer workers.

Offers:
    LocalTransport   one rank in process: plain calls, no serialization, no thread hop of its own
"""

from __future__ import annotations

from kvmgr.transport.local import LocalTransport

__all__ = ["LocalTransport"]
