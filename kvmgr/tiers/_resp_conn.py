"""One RESP connection of the shared tier: send commands from their buffers, read replies.

Private to ``kvmgr.tiers``. Offers:
    Connection   one connected, authenticated socket (``kvmgr.tiers._resp_connect.connect``
                 opens it): ``send`` (``sendmsg`` straight from the command's buffers),
                 ``read_reply``, ``read_bulk_into`` (``recvmsg_into`` straight into the
                 caller's buffers); socket errors become typed tier errors and mark it broken

Every call takes an absolute ``deadline`` (``time.monotonic()`` seconds): each system call's
socket timeout is what is left of it. ``kvmgr.tiers._resp`` says why this is not redis-py.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Any

from kvmgr.errors import TierError, TierTimeoutError, TierUnavailableError
from kvmgr.tiers._resp import CRLF, Endpoint, ReplyError, nbytes, ssl_reason

__all__ = ["BUFFER_BYTES", "Connection"]

BUFFER_BYTES = 4096  # replies' headers are read through this buffer (and what comes with them)
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)


class Connection:
    """One connected socket; one thread at a time. ``broken`` after any failure (close it)."""

    def __init__(self, sock: socket.socket, endpoint: Endpoint) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.is_tls = isinstance(sock, ssl.SSLSocket)
        self.broken = False
        self._buf = bytearray(BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._crlf = bytearray(2)
        self._lo = self._hi = 0

    def close(self) -> None:
        """Close the socket (idempotent)."""
        self.broken = True
        with contextlib.suppress(OSError):
            self.sock.close()

    # ---- sending --------------------------------------------------------------------------

    def send(self, buffers: Sequence[Any], deadline: float) -> None:
        """Write every buffer, in order (``sendmsg`` in runs of up to IOV_MAX buffers; TLS:
        small buffers coalesced, then ``sendall``).

        Raises:
            TierTimeoutError, TierUnavailableError: as ``_io``.
        """
        with self._io(deadline, "send"):
            if self.is_tls:
                self._send_tls(buffers, deadline)
                return
            bufs = list(buffers)
            i = 0
            while i < len(bufs):
                self._timeout(deadline)
                sent = self.sock.sendmsg(bufs[i : i + _IOV_MAX])
                while sent:
                    size = nbytes(bufs[i])
                    if sent >= size:
                        sent -= size
                        i += 1
                    else:
                        bufs[i] = memoryview(bufs[i]).cast("B")[sent:]
                        sent = 0

    def _send_tls(self, buffers: Sequence[Any], deadline: float) -> None:
        small: list[Any] = []
        for buf in buffers:
            if memoryview(buf).nbytes < 16384:
                small.append(buf)
                continue
            if small:
                self._timeout(deadline)
                self.sock.sendall(b"".join(small))
                small = []
            self._timeout(deadline)
            self.sock.sendall(buf)
        if small:
            self._timeout(deadline)
            self.sock.sendall(b"".join(small))

    # ---- receiving ------------------------------------------------------------------------

    def read_reply(self, deadline: float) -> Any:
        """One reply: ``bytes`` (simple string), ``int``, ``bytearray`` or ``None`` (bulk),
        ``list`` (array), or a ``ReplyError``.

        Raises:
            TierTimeoutError, TierUnavailableError: as ``_io``; TierError: not RESP.
        """
        with self._io(deadline, "read"):
            return self._reply(deadline)

    def read_bulk_into(
        self, buffers: Sequence[Any], deadline: float, total: int | None = None
    ) -> Any:
        """A bulk reply of exactly the buffers' total length (``total``, when the caller knows
        it), received into them.

        Returns ``True`` (landed in ``buffers``), ``None`` (nil: no such key), a ``ReplyError``,
        or ``False`` (a value of another length, read and dropped; the buffers untouched).

        Raises:
            TierTimeoutError, TierUnavailableError: as ``_io``; TierError: not RESP.
        """
        with self._io(deadline, "read"):
            line = self._line(deadline)
            if line[:1] != b"$":
                return self._finish(line, deadline)
            size = int(line[1:])
            if size < 0:
                return None
            if size != (sum(map(nbytes, buffers)) if total is None else total):
                self._skip(size + 2, deadline)
                return False
            self._read_into([*buffers, self._crlf], deadline)  # the value and its CRLF at once
            return True

    def _reply(self, deadline: float) -> Any:
        return self._finish(self._line(deadline), deadline)

    def _finish(self, line: bytes, deadline: float) -> Any:
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return bytes(rest)
        if kind == b"-":
            return ReplyError(bytes(rest))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            value = bytearray(size)
            self._read_into([value], deadline)
            self._skip(2, deadline)
            return value
        if kind == b"*":
            size = int(rest)
            return None if size < 0 else [self._reply(deadline) for _ in range(size)]
        raise TierError(f"server {self.endpoint.address}: not a RESP reply")

    def _line(self, deadline: float) -> bytes:
        while True:
            end = self._buf.find(CRLF, self._lo, self._hi)
            if end >= 0:
                line = bytes(self._view[self._lo : end])
                self._lo = end + 2
                return line
            self._fill(deadline)

    def _fill(self, deadline: float) -> None:
        """Receive more bytes into the small buffer (compacting it first)."""
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._hi == len(self._buf):
            if self._lo == 0:  # a header line longer than the buffer: grow it
                self._buf.extend(bytes(len(self._buf)))
                self._view = memoryview(self._buf)
            else:
                kept = self._hi - self._lo
                self._buf[:kept] = self._buf[self._lo : self._hi]
                self._lo, self._hi = 0, kept
        self._timeout(deadline)
        got = self.sock.recv_into(self._view[self._hi :])
        if not got:
            raise ConnectionResetError("the server closed the connection")
        self._hi += got

    def _read_into(self, buffers: Sequence[Any], deadline: float) -> None:
        """Fill ``buffers`` in order: first from the small buffer, then straight from the
        socket (``recvmsg_into``; TLS: ``recv_into`` per buffer)."""
        views = [memoryview(b).cast("B") for b in buffers]
        i = 0
        while i < len(views) and self._lo < self._hi:  # bytes already read ahead
            take = min(views[i].nbytes, self._hi - self._lo)
            views[i][:take] = self._view[self._lo : self._lo + take]
            self._lo += take
            views[i] = views[i][take:]
            if not views[i].nbytes:
                i += 1
        while i < len(views):
            self._timeout(deadline)
            if self.is_tls:
                got = self.sock.recv_into(views[i])
            else:
                got = self.sock.recvmsg_into(views[i : i + _IOV_MAX])[0]
            if not got:
                raise ConnectionResetError("the server closed the connection")
            while got:
                size = views[i].nbytes
                if got >= size:
                    got -= size
                    i += 1
                else:
                    views[i] = views[i][got:]
                    got = 0

    def _skip(self, num_bytes: int, deadline: float) -> None:
        buffered = min(num_bytes, self._hi - self._lo)
        self._lo += buffered
        left = num_bytes - buffered
        while left:
            chunk = bytearray(min(left, 1 << 20))
            self._read_into([chunk], deadline)
            left -= len(chunk)

    # ---- time and errors ------------------------------------------------------------------

    def _timeout(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline")
        self.sock.settimeout(left)

    def _io(self, _deadline: float, what: str) -> _IOGuard:
        return _IOGuard(self, what)


class _IOGuard:
    """Maps socket errors to typed tier errors and marks the connection broken."""

    __slots__ = ("conn", "what")

    def __init__(self, conn: Connection, what: str) -> None:
        self.conn = conn
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, _tb: Any) -> bool:
        if exc is None:
            return False
        self.conn.close()
        where = f"server {self.conn.endpoint.address}"
        if isinstance(exc, TierError):
            return False
        if isinstance(exc, socket.timeout | TimeoutError):
            raise TierTimeoutError(f"{where}: {self.what} passed the deadline") from None
        if isinstance(exc, ssl.SSLError):
            raise TierUnavailableError(f"{where}: TLS error: {ssl_reason(exc)}") from None
        if isinstance(exc, OSError):
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise TierUnavailableError(f"{where}: {self.what} failed: {reason}") from None
        if isinstance(exc, ValueError):  # a length or an int that does not parse
            raise TierError(f"{where}: not a RESP reply") from None
        return False
