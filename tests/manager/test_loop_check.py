"""The manager's running-loop check without ``get_running_loop`` on every call (percall3):
once a call found the bound loop running, the next ones test that it still runs in this thread
(``ManagerCore._fast_loop``). Random programs of calls inside loops, outside any loop, from
another thread, across a second loop, after close and in a forked child get the outcomes and
the state they get with the check made by asyncio each time (``_fast_loop`` never set)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import sys
import threading
from typing import Any

import pytest
import torch

import kvmgr.manager.core as core
from kvmgr import ManagerConfig, OffloadManager
from kvmgr.errors import ClosedError, EventLoopError, KVMgrError
from kvmgr.testing import NullEngine

K = [hashlib.blake2b(b"loop%d" % i, digest_size=16).digest() for i in range(400)]


def _manager() -> OffloadManager:
    config = ManagerConfig(num_cpu_blocks=64)
    return OffloadManager([torch.zeros(64, 2, 4)], config, engine=NullEngine())


def _outcome(fn: Any) -> Any:
    try:
        got = fn()
    except KVMgrError as exc:
        return type(exc).__name__
    return type(got).__name__


def _program(seed: int) -> list[Any]:
    rng, out, keys = random.Random(seed), [], iter(K)
    mgr = _manager()
    ids = mgr.allocate("r", 64)

    def store() -> Any:
        i = rng.randrange(64)
        return mgr.swap_out([ids[i]], [next(keys)])

    def in_thread() -> Any:
        got: list[Any] = []
        worker = threading.Thread(target=lambda: got.append(_outcome(store)))
        worker.start()
        worker.join()
        return got[0]

    async def run(steps: int) -> None:
        for _ in range(steps):
            op = rng.random()
            if op < 0.6:
                out.append(_outcome(store))
            elif op < 0.7:
                out.append(("thread", in_thread()))
            elif op < 0.8:
                out.append(("load", _outcome(lambda: mgr.swap_in(K[:1], [ids[63]]))))
            elif op < 0.97:
                try:
                    out.append(("step", (await mgr.step()).step))
                except KVMgrError as exc:
                    out.append(("step", type(exc).__name__))
            else:  # closed in the loop: the next calls in it raise ClosedError
                await mgr.aclose()
        if not mgr.closed:
            await mgr.step()
            await asyncio.sleep(0)

    for _ in range(rng.randint(2, 4)):
        asyncio.run(run(rng.randint(3, 12)))  # a new loop each time
        out.append(("outside", _outcome(store)))
        if rng.random() < 0.2:
            mgr.close()
    asyncio.run(run(3))
    out.append(sorted(mgr.snapshot().keys))
    mgr.close()
    return out


@pytest.mark.parametrize("seed", range(12))
def test_random_programs_get_asyncios_outcomes(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _program(seed)
    monkeypatch.setattr(core, "BaseEventLoop", type("NoLoop", (), {}))  # never fast
    general = _program(seed)
    assert fast == general
    assert "EventLoopError" in str(fast) and "CallFuture" in str(fast)


def test_the_programs_close_inside_a_loop_and_call_again() -> None:
    assert any("ClosedError" in str(_program(seed)) for seed in range(12))


@pytest.mark.asyncio
async def test_the_fast_check_is_taken_and_cleared_at_close() -> None:
    mgr = _manager()
    ids = mgr.allocate("r", 2)
    mgr.swap_out(ids[:1], K[:1])
    assert mgr._fast_loop is asyncio.get_running_loop()
    await mgr.step()
    await mgr.aclose()
    assert mgr._fast_loop is None
    with pytest.raises(ClosedError):
        mgr.swap_out(ids[1:], K[1:2])


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="fork")
def test_a_forked_child_has_no_running_loop() -> None:
    mgr = _manager()
    ids = mgr.allocate("r", 2)

    async def fork() -> int:
        mgr.swap_out(ids[:1], K[:1])
        assert mgr._fast_loop is not None
        pid = os.fork()
        if pid == 0:  # the child: asyncio sees no running loop here, nor may the manager
            code = 3
            try:
                mgr.swap_out(ids[1:], K[1:2])
            except EventLoopError:
                code = 0
            except BaseException:
                code = 2
            os._exit(code)
        await mgr.step()
        return pid

    pid = asyncio.run(fork())
    _, status = os.waitpid(pid, 0)
    mgr.close()
    assert os.waitstatus_to_exitcode(status) == 0
