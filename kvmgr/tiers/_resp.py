"""RESP2 over one socket for the shared tier: commands sent straight from their buffers, blob
replies received straight into the caller's buffers (private to ``kvmgr.tiers``).

Offers (the protocol's values; the socket is ``_resp_conn.Connection``, opened by
``_resp_connect.connect``):
    Endpoint     where a server is and how to reach it (TCP or unix socket, TLS, credentials, db)
    ReplyError   a server error reply (``-MOVED ...``, ``-OOM ...``), returned as a value
    command      one command as a list of buffers (arguments kept as given: no join, no copy)
    nbytes       the length of any buffer
    ssl_reason   why a TLS call failed, in words

Why not redis-py here: its clients join a pipeline into one buffer before writing it and copy
each reply value 2-4 times (reader buffer, parser, bytes object) before a caller sees it, which
measured 0.24-0.68 of a zero-copy client on 0.2-2 MiB values (issue 26). This module writes
``SET`` with ``socket.sendmsg`` from the blob's own buffers (the CPU tier's pages) and reads a
``GET`` reply with ``recvmsg_into`` into the destination pages; only headers (a few bytes per
reply, plus at most ``_resp_conn.BUFFER_BYTES`` read ahead) pass through its small buffer. It speaks the
handful of commands the tier uses (``AUTH``, ``SELECT``, ``GET``, ``SET``, ``EXISTS``,
``UNLINK``, ``ASKING``, ``CLUSTER SLOTS``, ``PING``); redis-py still computes cluster hash slots
(``redis.crc.key_slot``).

Every blocking call takes an absolute ``deadline`` (``time.monotonic()`` seconds): the socket
timeout of each system call is what is left of it, so a worker thread never outlives its
deadline by more than one call's slack. Errors are the typed tier errors of ``kvmgr.errors``;
messages never carry credentials.
"""

from __future__ import annotations

import ssl
from typing import Any

import attrs

__all__ = ["CRLF", "Endpoint", "ReplyError", "command", "nbytes", "ssl_reason"]

CRLF = b"\r\n"


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
        if isinstance(arg, list):
            arg = (arg, sum(map(nbytes, arg)))
        if isinstance(arg, tuple):
            buffers, size = arg
            head.append(b"$%d\r\n" % size)
            out.append(b"".join(head))
            out.extend(buffers)
            head = [CRLF]
            continue
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        head.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    out.append(b"".join(head))
    return out


def ssl_reason(exc: ssl.SSLError) -> str:
    """Why a TLS call failed, in words (with a hint for the usual mistakes)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"the server's certificate was not accepted ({exc.verify_message})"
    reason = getattr(exc, "reason", None) or type(exc).__name__
    if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"):
        return f"{reason} (is this a plain-TCP port? use redis:// for it, rediss:// for TLS)"
    if reason in ("TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_HANDSHAKE_FAILURE"):
        return f"{reason} (the server asks for a client certificate: ssl_certfile, ssl_keyfile)"
    return str(reason)
