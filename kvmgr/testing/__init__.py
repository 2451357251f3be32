"""What users need to test their own serving loops against kvmgr: faults, fake time, invariants.

Offers:
    ScriptedEngine    the one test engine: copies on a real engine (or not at all) and fails,
                      delays, hangs, holds, refuses, rewrites or records batches on cue
    FaultyEngine      ``ScriptedEngine`` over a real engine (seeded faults)
    NullEngine        ``ScriptedEngine`` copying nothing; completes at once or when told
    VirtualClock      monotonic fake time for an asyncio loop, advanced only by the test
    check_invariants  raises ``InvariantError`` naming every broken manager invariant
    InvariantError    the ``AssertionError`` that ``check_invariants`` raises
    POISON_BYTE       what a scripted engine writes over the CPU blocks of a failed store

Typical use (see docs/reliability.md)::

    engine = FaultyEngine(HostEngine(), fail_batches={1}, seed=0)
    async with OffloadManager(kv_caches, config, engine=engine) as mgr:
        ...                       # drive the manager as the serving loop does
        check_invariants(mgr)     # after every step of the test

``check_invariants`` reads only ``OffloadManager.snapshot()`` and the engines' public
properties.
"""

from __future__ import annotations

from kvmgr.testing.clock import VirtualClock
from kvmgr.testing.faults import POISON_BYTE, FaultyEngine, NullEngine
from kvmgr.testing.invariants import InvariantError, check_invariants
from kvmgr.testing.scripted import ScriptedEngine

__all__ = [
    "POISON_BYTE",
    "FaultyEngine",
    "InvariantError",
    "NullEngine",
    "ScriptedEngine",
    "VirtualClock",
    "check_invariants",
]
