"""A dead rank's pipe is at end-of-file for good: the scheduler's loop stops watching it.

Found by a new user (round 4, session 13, newuser15): after a rank died the transport kept the
dead pipe's reader on the event loop; a closed pipe is always readable, so every loop turn
called the reader again (about 60,000 times a second on the 2-core VM: one core busy) for as
long as the serving loop went on without offload, as the guide says it may.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))  # the rank processes import ranks_support

from ranks_support import make_rank

from kvmgr import ManagerConfig, OffloadManager, RankError, RankTimeoutError
from kvmgr.testing import check_invariants
from kvmgr.transport import RankGroup, rank_transport

KEYS = [b"key-%02d" % i for i in range(4)]


def _spec(**extra: Any) -> dict[str, Any]:
    return {"num_gpu_blocks": 16, "num_cpu_blocks": 12, "seed": 7, **extra}


@pytest.mark.parametrize("kind", ["kill", "die"])
def test_a_dead_ranks_pipe_is_no_longer_read_by_the_loop(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    readable = rank_transport.RankTransport._readable

    def counted(self: Any, rank: int) -> None:
        calls.append(rank)
        readable(self, rank)

    monkeypatch.setattr(rank_transport.RankTransport, "_readable", counted)
    fault = {"rank": 1, "kind": "die", "from_batch": 1} if kind == "die" else None
    group = RankGroup(2, make_rank, (_spec(fault=fault) if fault else _spec(),), deadline_s=30)
    try:

        async def main() -> None:
            mgr = OffloadManager.over_ranks(group, ManagerConfig(num_cpu_blocks=12, engine="host"))
            try:
                first = mgr.swap_out(mgr.allocate("a", 2), KEYS[:2])
                await mgr.step()
                await mgr.wait(first, timeout_s=20)
                if kind == "kill":
                    group.kill(1)
                    group.processes[1].join(5)
                second = mgr.swap_out(mgr.allocate("b", 2), KEYS[2:])
                await mgr.step()
                with pytest.raises(RankError):
                    await mgr.wait(second, timeout_s=20)
                check_invariants(mgr)
                loop = asyncio.get_running_loop()
                for _ in range(50):  # loop turns: a watched dead pipe is read at every one
                    await asyncio.sleep(0)
                assert calls.count(1) < 10
                assert not loop.remove_reader(group.jobs[1].fileno())  # no longer watched
            finally:
                await mgr.aclose(timeout_s=10)

        asyncio.run(main())
    finally:
        group.close()


def test_a_stuck_rank_whose_pipe_is_full_still_meets_the_deadline(tmp_path: Path) -> None:
    """Rank 1 is stuck inside the first job (it reads no more frames); the scheduler goes on
    storing one block a step. Its pipe's buffer fills after a few hundred frames: a blocking
    write then held the event loop until the rank came back, so the 0.3 s deadline never
    fired (with a rank hung for good: a hang). Now the frames wait in the scheduler and the
    deadline takes the group down while the rank is still stuck."""
    gate = tmp_path / "gate"
    fault = {"rank": 1, "kind": "gate", "path": str(gate), "delay_s": 20.0, "from_batch": 0}
    group = RankGroup(2, make_rank, (_spec(num_gpu_blocks=1024, fault=fault),), deadline_s=0.3)
    config = ManagerConfig(num_cpu_blocks=1000, engine="host")
    try:

        async def main() -> None:
            mgr = OffloadManager.over_ranks(group, config)
            try:
                first = mgr.swap_out(mgr.allocate("r0", 1), [b"k-0"])
                swaps = [first]
                for i in range(1, 1000):  # more frames than the pipe holds
                    swaps.append(mgr.swap_out(mgr.allocate(f"r{i}", 1), [b"k-%d" % i]))
                    await mgr.step()
                with pytest.raises(RankTimeoutError):
                    await mgr.wait(first, timeout_s=30)
                assert not (tmp_path / "gate.gave_up").exists()  # met while rank 1 was stuck
                gate.touch()
                for swap in swaps:
                    with pytest.raises(RankError):
                        await mgr.wait(swap, timeout_s=30)
                check_invariants(mgr)
            finally:
                await mgr.aclose(timeout_s=10)

        asyncio.run(main())
    finally:
        gate.touch()
        group.close()
