"""CUDA stand-ins for the host-cost scripts that run the CUDA engines on CPU
(``scripts/submit_cost.py``, ``scripts/step_engine_ab.py``).

``install()`` replaces ``torch.cuda``'s streams and events with objects that do nothing, makes
host registration a no-op, gives the copy kernel plain CPU tensors for its table slots and stubs
its two launches (they return the number of programs they would have launched). Everything else
the engines run is the real code. It imports kvmgr only when called, so the tree on
``PYTHONPATH`` decides which kvmgr it patches (an A/B run over two trees).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class Stream:
    """``torch.cuda.Stream`` stand-in: a fixed handle, every operation a no-op."""

    cuda_stream = 0x1234
    device = torch.device("cpu")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Event:
    """``torch.cuda.Event`` stand-in: always complete, 0 ms elapsed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Any) -> float:
        return 0.0


def install() -> None:
    """Patch ``torch.cuda``, host registration and the copy kernel's table slots and launches
    for the rest of the process (these scripts run nothing else)."""
    from kvmgr.kernels.copy import staging
    from kvmgr.transfer import pinned

    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.Stream = Stream  # type: ignore[assignment,misc]
    torch.cuda.Event = Event  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: Stream()  # type: ignore[assignment]
    torch.cuda.device = lambda device: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.stream = lambda stream: contextlib.nullcontext()  # type: ignore[assignment]
    pinned.torch_registrar = lambda: pinned.HostRegistrar(lambda a, n: None, lambda a: None)

    def slot(capacity: int, device: Any) -> Any:
        host, table = (torch.zeros(3 * capacity, dtype=torch.int64) for _ in range(2))
        return staging.TableSlot(capacity, host, host.numpy(), table, host.data_ptr(),
                                 table.data_ptr())  # fmt: skip

    staging.new_table_slot = slot  # type: ignore[assignment]
    staging.launch_copy_table = lambda table, n, programs, **kw: min(n, programs)  # type: ignore[assignment]
    staging.launch_block_table = lambda layout, runs, t, n, programs, **kw: min(t * n, programs)  # type: ignore[assignment]
