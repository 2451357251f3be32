"""Round 4, session 13 (newuser14): what a fifth new user hit.

1. ``StepContext(stream=...)`` took anything. On a CPU machine ``step(ctx)`` then ignored a
   stream that is no stream (``"x"``, a stream's integer id) without a word; on a GPU,
   ``torch.cuda.stream(ctx.stream)`` raised ``AttributeError`` inside ``step()`` after the hooks
   had run and the step counter had moved. ``stream_wait_loads`` already refused such a stream
   with ``InvalidArgumentError``; ``StepContext`` now applies the same rule when it is built.
"""

from __future__ import annotations

import pytest

from kvmgr import StepContext
from kvmgr.errors import InvalidArgumentError


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
