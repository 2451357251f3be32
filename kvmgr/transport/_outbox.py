"""Frames for one rank's job pipe, written without ever blocking the scheduler's loop.

A rank that is stuck inside a job (a hung copy, a stopped process) reads no more frames; its
pipe's buffer fills after a few hundred small jobs or one large one. A blocking
``Connection.send_bytes`` then held the event loop for as long as the rank was stuck, so the
deadline timer that should have taken the group down never ran. ``Outbox`` writes each frame in
``multiprocessing.connection``'s wire format (a 4-byte big-endian length, or ``-1`` and an 8-byte
length above 2 GiB, then the bytes) with ``MSG_DONTWAIT`` and keeps what did not fit, in order,
for the loop's writer callback (``RankTransport``) to send when the pipe has room.
"""

from __future__ import annotations

import os
import socket
import struct
from collections import deque
from typing import Any

__all__ = ["Outbox"]


def _framed(data: bytes) -> bytes:
    n = len(data)
    if n > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", n) + data
    return struct.pack("!i", n) + data


class Outbox:
    """One rank's unsent frames (``job_id``, rest of its bytes), oldest first.

    Args:
        conn: the scheduler's end of the rank's job pipe (a ``multiprocessing`` ``Connection``
            over a Unix socket; anything else is written with its own blocking ``send_bytes``).
    """

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.fd: int = conn.fileno()
        self.frames: deque[tuple[int, memoryview]] = deque()
        self.started = False  #: the oldest frame is partly written
        try:
            self._sock: socket.socket | None = socket.socket(fileno=os.dup(self.fd))
        except OSError:  # not a socket
            self._sock = None
        else:  # the descriptor stays blocking for ``conn``'s reads (a default timeout would not)
            self._sock.setblocking(True)

    def put(self, job_id: int, data: bytes) -> bool:
        """Queue one frame and write what fits now; ``True`` once nothing is left unsent.

        Raises:
            OSError: the pipe is closed (the rank is gone).
        """
        if self._sock is None:
            self.conn.send_bytes(data)
            return True
        self.frames.append((job_id, memoryview(_framed(data))))
        return self.drain()

    def drain(self) -> bool:
        """Write queued bytes until the pipe is full; ``True`` once none are left.

        Raises:
            OSError: the pipe is closed (the rank is gone).
        """
        assert self._sock is not None or not self.frames
        while self.frames:
            job_id, view = self.frames[0]
            try:
                n = self._sock.send(view, socket.MSG_DONTWAIT)  # type: ignore[union-attr]
            except BlockingIOError:
                return False
            if n < len(view):
                self.frames[0] = (job_id, view[n:])
                self.started = True
                return False
            self.frames.popleft()
            self.started = False
        return True

    def drop_unstarted(self) -> list[int]:
        """Forget the frames not begun (the group is down: they are never sent); a frame partly
        written is kept, so the rank never reads a cut frame. Returns the dropped job ids."""
        keep = [self.frames.popleft()] if self.frames and self.started else []
        dropped = [job_id for job_id, _ in self.frames]
        self.frames.clear()
        self.frames.extend(keep)
        return dropped

    def close(self) -> None:
        """Close this outbox's own handle on the pipe (the pipe itself is the group's)."""
        if self._sock is not None:
            self._sock.close()
