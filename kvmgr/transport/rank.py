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
    lock = threading.Lock()

    def send(frame: DoneFrame) -> None:
        with lock, contextlib.suppress(OSError):  # the scheduler is gone: nothing to tell
            jobs.send_bytes(encode(frame))

    def on_done(job_id: int, future: Any) -> None:
        worker.forget(job_id)
        error = future.exception()
        if error is not None:
            send(DoneFrame(job_id, rank, f"{type(error).__name__}: {error}"))
            return
        result = future.result()
        send(DoneFrame(job_id, rank, None, result.num_bytes, result.device_s))

    while True:
        for conn in wait([jobs, control]):
            try:
                frame = decode(conn.recv_bytes())
            except (EOFError, OSError):  # the scheduler closed its end: stop
                worker.close(5.0)
                return
            if isinstance(frame, JobFrame):
                job = job_of(frame)
                try:
                    handle = worker.submit(job).handle
                except Exception as exc:  # refused: the job fails on this rank, reported
                    send(DoneFrame(job.job_id, rank, f"{type(exc).__name__}: {exc}"))
                    continue
                handle.future.add_done_callback(lambda f, j=job.job_id: on_done(j, f))
            elif isinstance(frame, DumpFrame):
                gpu = [_raw(t) for t in worker.tensors]
                cpu = [t.numpy().tobytes() for t in worker.cpu_pool.tensors]
                control.send_bytes(encode(PagesFrame(rank, gpu, cpu)))
            elif isinstance(frame, CloseFrame):
                error = None
                try:
                    worker.close(frame.timeout_s)
                except Exception as exc:  # copies still running past the timeout
                    error = f"{type(exc).__name__}: {exc}"
                control.send_bytes(encode(ClosedFrame(rank, error)))
                return


def _raw(tensor: Any) -> bytes:
    """A tensor's bytes (copied to the host first when it lives on a GPU)."""
    import torch

    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
