"""Round 4, session 13 (newuser14): what a fifth new user hit.

1. ``StepContext(stream=...)`` took anything. On a CPU machine ``step(ctx)`` then ignored a
   stream that is no stream (``"x"``, a stream's integer id) without a word; on a GPU,
   ``torch.cuda.stream(ctx.stream)`` raised ``AttributeError`` inside ``step()`` after the hooks
   had run and the step counter had moved. ``stream_wait_loads`` already refused such a stream
   with ``InvalidArgumentError``; ``StepContext`` now applies the same rule when it is built.
2. A close past its timeout fails the swaps in flight with ``ClosedError`` while their copies
   may still run; the README's rule for caller-owned blocks ("reuse once the future resolved
   with a result or an error") did not say so (docs fixed; the test pins ``gpu_busy``).
"""

from __future__ import annotations

import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager, StepContext
from kvmgr.errors import ClosedError, InvalidArgumentError, TransferTimeoutError
from kvmgr.testing import FaultyEngine
from kvmgr.transfer import HostEngine

KEYS = [b"a" * 16, b"b" * 16]


class _FakeStream:
    def wait_event(self, event: object) -> None:  # what the rule asks of a stream
        pass


@pytest.mark.parametrize("stream", ["x", 7, object()], ids=["str", "int", "object"])
def test_a_step_context_with_a_stream_that_is_no_stream_is_an_invalid_argument(stream) -> None:
    with pytest.raises(InvalidArgumentError, match="stream"):
        StepContext(stream=stream)


def test_a_step_context_takes_none_or_a_stream() -> None:
    assert StepContext().stream is None
    fake = _FakeStream()
    assert StepContext(stream=fake).stream is fake


# 2. With caller-owned GPU blocks the README says a block may be reused once its swap's future
#    "resolved with a result or an error". A close past its timeout fails the swaps in flight
#    with ClosedError while their copies may still run (a hung stream): the docs now say so, and
#    that snapshot().gpu_busy keeps naming those blocks after close, which this pins.


@pytest.mark.asyncio
@pytest.mark.parametrize("closing", ["close", "aclose"])
@pytest.mark.parametrize("what", ["store", "load"])
async def test_a_swap_failed_by_a_timed_out_close_keeps_its_blocks_busy(closing, what) -> None:
    kv = [torch.zeros(8, 4, 16, dtype=torch.uint8)]
    engine = FaultyEngine(HostEngine(), hang_batches={1}, close_hangs=True)
    config = ManagerConfig(num_cpu_blocks=8, manage_gpu_blocks=False)
    mgr = OffloadManager(kv, config, engine=engine)
    mgr.append_blocks("a", [0, 1])
    first = mgr.swap_out([0, 1], KEYS)
    await mgr.step()
    await first
    mgr.append_blocks("b", [2, 3])
    if what == "store":
        future = mgr.swap_out([2, 3], [b"c" * 16, b"d" * 16])
    else:
        future = mgr.swap_in(KEYS, [2, 3])
    await mgr.step()  # the copy hangs in flight
    with pytest.raises(TransferTimeoutError):
        if closing == "close":
            mgr.close(0.05)
        else:
            await mgr.aclose(0.05)
    assert future.done() and isinstance(future.exception(), ClosedError)
    assert set(mgr.snapshot().gpu_busy) == {2, 3}  # not reusable: the copy may still run
