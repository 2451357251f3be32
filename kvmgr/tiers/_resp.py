"""RESP2 over one socket for the shared tier: commands sent straight from their buffers, blob
replies received straight into the caller's buffers (private to ``kvmgr.tiers``).

Offers:
    Endpoint     where a server is and how to reach it (TCP or unix socket, TLS, credentials, db)
    Connection   one connected, authenticated socket: ``send``, ``read_reply``, ``read_bulk_into``
    ReplyError   a server error reply (``-MOVED ...``, ``-OOM ...``), returned as a value
    command      one command as a list of buffers (arguments kept as given: no join, no copy)
    connect      open, TLS-wrap and authenticate a ``Connection`` under a deadline

Why not redis-py here: its clients join a pipeline into one buffer before writing it and copy
each reply value 2-4 times (reader buffer, parser, bytes object) before a caller sees it, which
measured 0.24-0.68 of a zero-copy client on 0.2-2 MiB values (issue 26). This module writes
``SET`` with ``socket.sendmsg`` from the blob's own buffers (the CPU tier's pages) and reads a
``GET`` reply with ``recvmsg_into`` into the destination pages; only headers (a few bytes per
reply, plus at most ``_BUFFER_BYTES`` read ahead) pass through its small buffer. It speaks the
handful of commands the tier uses (``AUTH``, ``SELECT``, ``GET``, ``SET``, ``EXISTS``,
``UNLINK``, ``ASKING``, ``CLUSTER SLOTS``, ``PING``); redis-py still computes cluster hash slots
(``redis.crc.key_slot``).

Every blocking call takes an absolute ``deadline`` (``time.monotonic()`` seconds): the socket
timeout of each system call is what is left of it, so a worker thread never outlives its
deadline by more than one call's slack. Errors are the typed tier errors of ``kvmgr.errors``;
messages never carry credentials.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Any

import attrs

from kvmgr.errors import TierError, TierTimeoutError, TierUnavailableError

__all__ = ["Connection", "Endpoint", "ReplyError", "command", "connect", "nbytes"]

_BUFFER_BYTES = 4096  # replies' headers are read through this buffer (and what comes with them)
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
_CRLF = b"\r\n"


@attrs.frozen(repr=False)
class Endpoint:
    """How to reach one server.

    Attributes:
        host, port: TCP address (``unix_path`` ``None``), or ``unix_path`` for a unix socket.
        tls: the client's TLS context, or ``None`` for plain TCP.
        username, password: ACL credentials (``password`` a ``Secret``), or ``None``.
        db: database index (``SELECT`` when not 0; cluster nodes only have 0).
        connect_timeout_s: TCP and TLS handshake timeout.
    """

    host: str
    port: int
    unix_path: str | None = None
    tls: ssl.SSLContext | None = None
    username: str | None = None
    password: Any = None
    db: int = 0
    connect_timeout_s: float = 1.0

    @property
    def address(self) -> str:
        """``host:port`` or the socket path (for messages; no credentials)."""
        return self.unix_path or f"{self.host}:{self.port}"

    def at(self, host: str, port: int) -> Endpoint:
        """The same settings for another node (cluster)."""
        return attrs.evolve(self, host=host, port=port, db=0)


class ReplyError:
    """A server error reply, e.g. ``b"MOVED 3999 127.0.0.1:7001"``; ``kind`` is its first word."""

    __slots__ = ("kind", "text")

    def __init__(self, text: bytes) -> None:
        self.text = text.decode("utf-8", "replace")
        self.kind = self.text.split(" ", 1)[0]

    def __repr__(self) -> str:
        return f"ReplyError({self.text[:80]!r})"


def nbytes(buffer: Any) -> int:
    """Bytes of a buffer (numpy arrays and memoryviews carry ``nbytes``; bytes use ``len``)."""
    size = getattr(buffer, "nbytes", None)
    return len(buffer) if size is None else int(size)


def command(*args: Any) -> list[Any]:
    """The RESP encoding of one command as buffers: ``bytes``/``str``/``int`` arguments are
    framed inline; a ``list`` argument is one bulk string made of its buffers (a blob's header
    and pages, sent as they are); a ``(list, size)`` tuple the same with its length given."""
    out: list[Any] = []
    head = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, tuple):
            arg, size = arg
            head.append(b"$%d\r\n" % size)
            out.append(b"".join(head))
            out.extend(arg)
            head = [_CRLF]
            continue
        if isinstance(arg, list):
            size = sum(map(nbytes, arg))
            head.append(b"$%d\r\n" % size)
            out.append(b"".join(head))
            out.extend(arg)
            head = [_CRLF]
            continue
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        head.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    out.append(b"".join(head))
    return out


class Connection:
    """One connected socket; one thread at a time. ``broken`` after any failure (close it)."""

    def __init__(self, sock: socket.socket, endpoint: Endpoint) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.is_tls = isinstance(sock, ssl.SSLSocket)
        self.broken = False
        self._buf = bytearray(_BUFFER_BYTES)
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
            end = self._buf.find(_CRLF, self._lo, self._hi)
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
            raise TierUnavailableError(f"{where}: TLS error: {_ssl_reason(exc)}") from None
        if isinstance(exc, OSError):
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise TierUnavailableError(f"{where}: {self.what} failed: {reason}") from None
        if isinstance(exc, ValueError):  # a length or an int that does not parse
            raise TierError(f"{where}: not a RESP reply") from None
        return False


def _ssl_reason(exc: ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"the server's certificate was not accepted ({exc.verify_message})"
    reason = getattr(exc, "reason", None) or type(exc).__name__
    if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"):
        return f"{reason} (is this a plain-TCP port? use redis:// for it, rediss:// for TLS)"
    if reason in ("TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_HANDSHAKE_FAILURE"):
        return f"{reason} (the server asks for a client certificate: ssl_certfile, ssl_keyfile)"
    return str(reason)


def connect(endpoint: Endpoint, deadline: float) -> Connection:
    """Open a connection to ``endpoint``: TCP (``TCP_NODELAY``) or unix socket, the TLS
    handshake, ``AUTH`` and ``SELECT``, all within ``min(connect_timeout_s, deadline)``.

    Raises:
        TierTimeoutError: the connect or handshake passed its time.
        TierUnavailableError: refused, unreachable, TLS failure (the reason named), or the
            credentials were refused ("authentication failed").
    """
    where = f"server {endpoint.address}"
    limit = min(deadline, time.monotonic() + endpoint.connect_timeout_s)
    left = limit - time.monotonic()
    if left <= 0:
        raise TierTimeoutError(f"{where}: no time left to connect")
    sock: socket.socket | None = None
    try:
        if endpoint.unix_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(left)
            sock.connect(endpoint.unix_path)
        else:
            sock = socket.create_connection((endpoint.host, endpoint.port), timeout=left)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if endpoint.tls is not None:
            sock.settimeout(max(1e-3, limit - time.monotonic()))
            sock = endpoint.tls.wrap_socket(sock, server_hostname=endpoint.host)
    except TimeoutError:
        _close(sock)
        if sock is not None and endpoint.tls is not None:
            raise TierTimeoutError(
                f"{where}: TLS handshake timed out (is this a plain-TCP port? use redis:// "
                "for it, rediss:// for TLS)"
            ) from None
        raise TierTimeoutError(f"{where}: connect timed out") from None
    except ssl.SSLError as exc:
        _close(sock)
        raise TierUnavailableError(f"{where}: TLS handshake failed: {_ssl_reason(exc)}") from None
    except OSError as exc:
        _close(sock)
        reason = exc.strerror or type(exc).__name__
        raise TierUnavailableError(f"{where}: connect failed: {reason}") from None
    conn = Connection(sock, endpoint)
    try:
        _handshake(conn, endpoint, deadline)
    except BaseException:
        conn.close()
        raise
    return conn


def _handshake(conn: Connection, endpoint: Endpoint, deadline: float) -> None:
    where = f"server {endpoint.address}"
    steps = []
    if endpoint.password is not None:
        secret = endpoint.password.reveal()
        user = [endpoint.username] if endpoint.username else []
        steps.append(("auth", command(b"AUTH", *user, secret)))
    elif endpoint.username:  # a user without a password (an ACL user with ``nopass``)
        steps.append(("auth", command(b"AUTH", endpoint.username, b"")))
    if endpoint.db:
        steps.append(("select", command(b"SELECT", endpoint.db)))
    if not steps:
        return
    conn.send([b for _name, cmd in steps for b in cmd], deadline)
    for name, _cmd in steps:
        reply = conn.read_reply(deadline)
        if isinstance(reply, ReplyError):
            if name == "auth":
                raise TierUnavailableError(f"{where}: authentication failed ({reply.kind})")
            raise TierUnavailableError(f"{where}: SELECT {endpoint.db} refused ({reply.kind})")


def _close(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.close()
