"""The frames between the scheduler and its rank processes (msgspec msgpack, tagged structs).

Private to ``kvmgr.transport``. Two pipes per rank: *jobs* (scheduler -> rank: ``JobFrame``;
rank -> scheduler: ``DoneFrame``, sent from the rank's engine thread as each copy ends) and
*control* (request / reply: ``Hello`` at start, ``DumpFrame`` -> ``PagesFrame``, ``CloseFrame``
-> ``ClosedFrame``). Block ids travel as the raw bytes of int64 arrays (no list of ints).
"""

from __future__ import annotations

import msgspec
import numpy as np

from kvmgr.scheduler.jobs import Direction, KVGeometry, TransferJob

__all__ = [
    "CloseFrame",
    "ClosedFrame",
    "DoneFrame",
    "DumpFrame",
    "Hello",
    "JobFrame",
    "PagesFrame",
    "decode",
    "encode",
    "job_frame",
    "job_of",
]


class Hello(msgspec.Struct, tag=True):
    """A rank is up: its KV geometry (checked against every other rank's)."""

    rank: int
    num_ranks: int
    num_gpu_blocks: int
    page_bytes: tuple[int, ...]
    layout: str

    def geometry(self) -> KVGeometry:
        return KVGeometry(self.num_gpu_blocks, self.page_bytes, self.layout, self.num_ranks)


class JobFrame(msgspec.Struct, tag=True):
    """A ``TransferJob``: ids as int64 bytes."""

    job_id: int
    d2h: bool
    gpu_ids: bytes
    cpu_ids: bytes
    wait_for: tuple[int, ...] = ()


class DoneFrame(msgspec.Struct, tag=True):
    """A rank's end of a job: ``error`` is ``None`` on success, else ``"Type: message"``."""

    job_id: int
    rank: int
    error: str | None = None
    num_bytes: int = 0
    device_s: float | None = None


class DumpFrame(msgspec.Struct, tag=True):
    """Ask a rank for the bytes of its KV tensors and CPU tier (tests, debugging)."""


class PagesFrame(msgspec.Struct, tag=True):
    """A rank's KV bytes: one ``bytes`` per GPU tensor and per CPU-tier tensor."""

    rank: int
    gpu: list[bytes]
    cpu: list[bytes]


class CloseFrame(msgspec.Struct, tag=True):
    """Close the rank's engine (bounded) and exit."""

    timeout_s: float = 5.0


class ClosedFrame(msgspec.Struct, tag=True):
    """The rank closed; ``error`` names a close that timed out."""

    rank: int
    error: str | None = None


Frame = Hello | JobFrame | DoneFrame | DumpFrame | PagesFrame | CloseFrame | ClosedFrame

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


def encode(frame: msgspec.Struct) -> bytes:
    """The frame's msgpack bytes."""
    return _encoder.encode(frame)


def decode(data: bytes) -> Frame:
    """A frame from its bytes.

    Raises:
        msgspec.DecodeError: not a frame.
    """
    return _decoder.decode(data)


def job_frame(job: TransferJob) -> JobFrame:
    """The frame of a job (its ids' int64 bytes, no copy beyond ``tobytes``)."""
    return JobFrame(
        job.job_id,
        job.direction is Direction.D2H,
        np.ascontiguousarray(job.gpu_ids, dtype=np.int64).tobytes(),
        np.ascontiguousarray(job.cpu_ids, dtype=np.int64).tobytes(),
        job.wait_for,
    )


def job_of(frame: JobFrame) -> TransferJob:
    """The job a frame carries."""
    return TransferJob(
        frame.job_id,
        Direction.D2H if frame.d2h else Direction.H2D,
        np.frombuffer(frame.gpu_ids, dtype=np.int64),
        np.frombuffer(frame.cpu_ids, dtype=np.int64),
        tuple(frame.wait_for),
    )
