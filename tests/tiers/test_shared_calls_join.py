"""A shared-tier call over several servers ends only once every server's job has let go of
its buffers, also when one job raises (``kvmgr.tiers._shared_calls.Dispatcher``; newuser14's
finding: ``asyncio.gather`` failed at the first error while the other jobs still ran, so the
caller could hand out rows a worker thread still wrote)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from kvmgr.tiers._nodes import Breaker
from kvmgr.tiers._resp import Endpoint
from kvmgr.tiers._shared_calls import Dispatcher
from kvmgr.tiers._shared_io import JobResult
from kvmgr.tiers.base import TierCounters

A, B = ("10.0.0.1", 7000), ("10.0.0.2", 7000)


def _dispatcher(executor: ThreadPoolExecutor) -> Dispatcher:
    slots = SimpleNamespace(stale=False, refreshed_at=time.monotonic(), nodes=[A, B],
                            owners=lambda keys: [A if k[0] % 2 else B for k in keys])  # fmt: skip
    return Dispatcher(Endpoint("10.0.0.1", 7000), lambda: Breaker(1.0, 2.0, 3), 2, slots,
                      executor, TierCounters("shared", "threads"), "redis://cluster")  # fmt: skip


@pytest.mark.parametrize("failing", ["first", "second"])
def test_a_raising_job_ends_the_call_only_after_the_other_jobs(failing: str) -> None:
    ended = threading.Event()

    def job(pool, keys, positions, deadline, asking):
        slow = (pool.endpoint.host, pool.endpoint.port) == (A if failing == "second" else B)
        if slow:
            time.sleep(0.3)  # still writing the rows it was given
            ended.set()
            return JobResult([b"v"] * len(keys))
        raise RuntimeError("a job's unexpected error")

    async def main() -> None:
        with ThreadPoolExecutor(4) as executor:
            dispatcher = _dispatcher(executor)
            with pytest.raises(RuntimeError, match="unexpected"):
                await dispatcher.run([b"\x01k", b"\x02k", b"\x03k"], job, 5.0, "get")
            assert ended.is_set()  # the slow job had let go before the call raised

    asyncio.run(main())
