"""CurrentStream: the current stream's object is rebuilt only when the raw handle changes."""

from __future__ import annotations

import pytest
import torch

from kvmgr.transfer import cuda_current
from kvmgr.transfer.cuda_current import CurrentStream


def test_the_stream_object_is_rebuilt_only_when_the_raw_handle_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = {"handle": 0x10}
    built: list[object] = []

    def current_stream(device: object = None) -> object:
        built.append(stream := object())
        return stream

    monkeypatch.setattr(cuda_current, "_raw_stream", lambda index: raw["handle"])
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    current = CurrentStream(torch.device("cuda", 0))
    first = current.current()
    assert current.current() is first and len(built) == 1  # same handle: the same object
    raw["handle"] = 0x20  # the caller entered torch.cuda.stream(other)
    second = current.current()
    assert second is not first and len(built) == 2
    raw["handle"] = 0x10  # and left it: the first handle's object is built again
    assert current.current() is built[-1] and len(built) == 3


def test_without_the_raw_reader_every_call_builds_the_object(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[object] = []
    monkeypatch.setattr(cuda_current, "_raw_stream", None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: built.append(0) or built)
    current = CurrentStream(torch.device("cuda", 0))
    current.current()
    current.current()
    assert len(built) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_the_object_follows_the_current_stream() -> None:
    current = CurrentStream(torch.device("cuda", 0))
    assert current.current() == torch.cuda.current_stream()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        assert current.current() == side
    assert current.current() == torch.cuda.current_stream()
