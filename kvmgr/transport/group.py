"""Several ranks, one process each: ``RankGroup`` starts them (``RankTransport``, in
``rank_transport.py``, drives them).

Each rank is a process forked from a ``forkserver`` that imported torch and kvmgr once, serving
its own ``TransferWorker`` (``rank.serve_rank``) over two Unix pipes: jobs and their answers on
one, start-up (``Hello``), page dumps and shutdown on the other (``control``). A group starts only when every rank
said hello with the same KV geometry; ranks whose geometry differs are refused at start with
``LayoutMismatchError``.

Layouts: under ``"heads"`` every rank holds its own 1/TP of each page (GQA) and copies every
block; under ``"replicated"`` (MLA) every rank holds the same latent cache, the CPU tier is one
shared-memory region mapped by every rank, a store is written by one rank per block (rotating
by CPU block id) and a load is read by all.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvmgr.errors import InvalidArgumentError, LayoutMismatchError, RankError
from kvmgr.scheduler.jobs import JobOutcome, KVGeometry
from kvmgr.transport.frames import (
    ClosedFrame,
    CloseFrame,
    DumpFrame,
    Hello,
    PagesFrame,
    decode,
    encode,
)
from kvmgr.transport.rank import serve_rank
from kvmgr.transport.rank_transport import RankTransport

__all__ = ["RankGroup", "RankTransport", "check_layouts"]

_Frame = TypeVar("_Frame")


def check_layouts(hellos: Sequence[Hello], num_ranks: int) -> KVGeometry:
    """The group's geometry (rank 0's), once every rank agrees with it.

    Raises:
        LayoutMismatchError: a rank's blocks, page bytes, layout or group size differ.
    """
    first = hellos[0]
    for hello in hellos:
        if hello.num_ranks != num_ranks:
            raise LayoutMismatchError(
                f"rank {hello.rank} believes the group has {hello.num_ranks} ranks, not "
                f"{num_ranks}",
                rank=hello.rank,
            )
        for name in ("num_gpu_blocks", "page_bytes", "layout"):
            mine, theirs = getattr(hello, name), getattr(first, name)
            if mine != theirs:
                raise LayoutMismatchError(
                    f"rank {hello.rank}: {name} {mine!r} differs from rank 0's {theirs!r} "
                    "(every rank must hold the same number of blocks and an equal share of "
                    "each page)",
                    rank=hello.rank,
                )
    return first.geometry()


class RankGroup:
    """``num_ranks`` worker processes, each serving its own ``TransferWorker``.

    Args:
        num_ranks: ranks to start (processes forked from a ``forkserver`` that imported torch
            and kvmgr once: no CUDA state is ever inherited, and a rank starts in ~0.1 s).
        make_worker: a picklable module-level function ``(rank, num_ranks, *args) ->
            TransferWorker`` run in each rank process (it allocates that rank's KV tensors or
            attaches to them, and its CPU-tier memory).
        args: more arguments for ``make_worker`` (picklable).
        deadline_s: seconds a job may take on every rank before the group is presumed down.
        start_timeout_s: seconds to wait for every rank's ``Hello``.

    Raises:
        InvalidArgumentError: ``num_ranks`` not an int >= 1, ``make_worker`` not callable, or
            a timeout not a finite number > 0 (before any process starts).
        RankError: a rank did not start in time, or exited (its traceback is on its stderr).
        LayoutMismatchError: the ranks' KV layouts differ (every rank is stopped first).
    """

    def __init__(
        self,
        num_ranks: int,
        make_worker: Callable[..., Any],
        args: Sequence[Any] = (),
        *,
        deadline_s: float = 30.0,
        start_timeout_s: float = 120.0,
    ) -> None:
        _check_args(num_ranks, make_worker, deadline_s, start_timeout_s)
        ctx = multiprocessing.get_context("forkserver")
        # the fork server imports these once; each rank is then forked from it (not spawned)
        ctx.set_forkserver_preload(["torch", "numpy", "msgspec", "kvmgr.transport.rank"])
        self.num_ranks = num_ranks
        self.deadline_s = deadline_s
        self.jobs: list[Any] = []
        self.control: list[Any] = []
        self.processes: list[Any] = []
        for rank in range(num_ranks):
            jobs, rank_jobs = ctx.Pipe()
            control, rank_control = ctx.Pipe()
            process = ctx.Process(
                target=serve_rank,
                args=(make_worker, tuple(args), rank, num_ranks, rank_jobs, rank_control),
                daemon=True,
                name=f"kvmgr-rank-{rank}",
            )
            process.start()
            rank_jobs.close()
            rank_control.close()
            self.jobs.append(jobs)
            self.control.append(control)
            self.processes.append(process)
        try:
            hellos = [self._hello(rank, start_timeout_s) for rank in range(num_ranks)]
            self.geometry = check_layouts(hellos, num_ranks)
        except BaseException:
            self.kill_all()
            raise

    def _hello(self, rank: int, timeout_s: float) -> Hello:
        frame = _answer(self.control[rank], Hello, timeout_s)
        if frame is None:
            process = self.processes[rank]
            process.join(1.0)  # a rank that exited (its make_worker raised) is reaped first
            code = "still running" if process.exitcode is None else f"exit code {process.exitcode}"
            raise RankError(
                f"rank {rank} did not start ({code}; a rank's error is on its stderr)", rank=rank
            )
        return frame

    def dump(self, rank: int, timeout_s: float = 30.0) -> PagesFrame:
        """The bytes of a rank's KV tensors and CPU tier (tests; call between steps).

        Raises:
            RankError: the rank did not answer.
        """
        conn = self.control[rank]
        try:
            conn.send_bytes(encode(DumpFrame()))
        except OSError:
            pass
        else:
            frame = _answer(conn, PagesFrame, timeout_s)
            if frame is not None:
                return frame
        raise RankError(f"rank {rank} did not answer a dump", rank=rank)

    def kill(self, rank: int) -> None:
        """Kill a rank's process (SIGKILL), as a crash would (fault tests)."""
        self.processes[rank].kill()

    def kill_all(self) -> None:
        """Kill every rank and close the pipes."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(5)
        for conn in self.jobs + self.control:
            conn.close()

    def close(self, timeout_s: float = 10.0) -> list[str]:
        """Close every rank (bounded); kill those that do not exit. Returns close errors."""
        errors = []
        for conn in self.control:
            with contextlib.suppress(OSError):
                conn.send_bytes(encode(CloseFrame(timeout_s)))
        deadline = time.monotonic() + timeout_s
        for rank, conn in enumerate(self.control):
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    frame = decode(conn.recv_bytes())
                    if isinstance(frame, ClosedFrame) and frame.error:
                        errors.append(f"rank {rank}: {frame.error}")
            except (EOFError, OSError):
                pass
        self.kill_all()
        return errors

    def connect(self, deliver: Callable[[JobOutcome], None]) -> RankTransport:
        """The transport over this group, delivering outcomes to ``deliver``."""
        return RankTransport(self, deliver)


def _check_args(num_ranks: object, make_worker: object, *timeouts: object) -> None:
    """Raises InvalidArgumentError: see ``RankGroup``."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, numbers.Integral) or num_ranks < 1:
        raise InvalidArgumentError(f"num_ranks: expected an int >= 1, got {num_ranks!r}")
    if not callable(make_worker):
        raise InvalidArgumentError(f"make_worker: expected a function, got {make_worker!r}")
    for name, value in zip(("deadline_s", "start_timeout_s"), timeouts):
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise InvalidArgumentError(f"{name}: expected seconds > 0, got {value!r}")


def _answer(conn: Any, kind: type[_Frame], timeout_s: float) -> _Frame | None:
    """The next frame on a control pipe if it comes within ``timeout_s`` and is a ``kind``;
    ``None`` otherwise (nothing came, another frame, or the pipe closed)."""
    try:
        if conn.poll(timeout_s):
            frame = decode(conn.recv_bytes())
            if isinstance(frame, kind):
                return frame
    except (EOFError, OSError):
        pass
    return None
