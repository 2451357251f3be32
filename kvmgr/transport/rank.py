"""The rank side of the multi-process transport: one process per rank, serving its worker.

``serve_rank`` is the target of each rank process (``RankGroup`` starts them): it builds the
rank's ``TransferWorker`` with the caller's factory, says ``Hello`` with its geometry, then
serves frames until told to close or until the scheduler's pipes close. Each job is submitted to
the worker at once; its ``DoneFrame`` is sent from the engine's completion (its own thread) or
at once when the submission fails, so the rank's main loop never waits on a copy.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import attrs

from kvmgr.transport.frames import (
    ClosedFrame,
    CloseFrame,
    DoneFrame,
    DumpFrame,
    Hello,
    JobFrame,
    PagesFrame,
    decode,
    encode,
    job_of,
)

__all__ = ["serve_rank"]


def serve_rank(
    make_worker: Callable[..., Any],
    args: Sequence[Any],
    rank: int,
    num_ranks: int,
    jobs: Connection,
    control: Connection,
) -> None:
    """Serve one rank: ``make_worker(rank, num_ranks, *args) -> TransferWorker``."""
    import torch

    torch.set_num_threads(1)
    worker = make_worker(rank, num_ranks, *args)
    g = worker.geometry
    control.send_bytes(
        encode(Hello(rank, num_ranks, g.num_gpu_blocks, tuple(g.page_bytes), g.layout))
    )
    server = _RankServer(worker, rank, jobs, control)
    while True:
        for conn in wait([jobs, control]):
            try:
                frame = decode(conn.recv_bytes())
            except (EOFError, OSError):  # the scheduler closed its end: stop
                worker.close(5.0)
                return
            if not server.handle(frame):
                return


@attrs.define(eq=False)
class _RankServer:
    """What one rank does with each frame; ``DoneFrame``s go out on ``jobs`` under ``lock``
    (sent from the engines' completion threads too)."""

    worker: Any
    rank: int
    jobs: Connection
    control: Connection
    lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    def handle(self, frame: Any) -> bool:
        """Serve one frame; ``False`` once it was a ``CloseFrame`` (answered)."""
        worker, rank = self.worker, self.rank
        if isinstance(frame, JobFrame):
            job = job_of(frame)
            try:
                handle = worker.submit(job).handle
            except Exception as exc:  # refused: the job fails on this rank, reported
                self.send(DoneFrame(job.job_id, rank, f"{type(exc).__name__}: {exc}"))
                return True
            handle.future.add_done_callback(lambda f, j=job.job_id: self.on_done(j, f))
        elif isinstance(frame, DumpFrame):
            gpu = [_raw(t) for t in worker.tensors]
            cpu = [t.numpy().tobytes() for t in worker.cpu_pool.tensors]
            self.control.send_bytes(encode(PagesFrame(rank, gpu, cpu)))
        elif isinstance(frame, CloseFrame):
            error = None
            try:
                worker.close(frame.timeout_s)
            except Exception as exc:  # copies still running past the timeout
                error = f"{type(exc).__name__}: {exc}"
            self.control.send_bytes(encode(ClosedFrame(rank, error)))
            return False
        return True

    def send(self, frame: DoneFrame) -> None:
        with self.lock, contextlib.suppress(OSError):  # the scheduler is gone: nothing to tell
            self.jobs.send_bytes(encode(frame))

    def on_done(self, job_id: int, future: Any) -> None:
        self.worker.forget(job_id)
        error = future.exception()
        if error is not None:
            self.send(DoneFrame(job_id, self.rank, f"{type(error).__name__}: {error}"))
            return
        result = future.result()
        self.send(DoneFrame(job_id, self.rank, None, result.num_bytes, result.device_s))


def _raw(tensor: Any) -> bytes:
    """A tensor's bytes (copied to the host first when it lives on a GPU)."""
    import torch

    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
