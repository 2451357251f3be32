"""Opening one RESP connection for the shared tier: TCP or unix socket, TLS, ``AUTH``, ``SELECT``.

Private to ``kvmgr.tiers``. Offers:
    connect   open, TLS-wrap and authenticate a ``kvmgr.tiers._resp.Connection`` under a
              deadline; every failure is a typed tier error whose message names the reason
              (never the credentials)
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time

from kvmgr.errors import TierTimeoutError, TierUnavailableError
from kvmgr.tiers._resp import Endpoint, ReplyError, command, ssl_reason
from kvmgr.tiers._resp_conn import Connection

__all__ = ["connect"]


def connect(endpoint: Endpoint, deadline: float) -> Connection:
    """Open a connection to ``endpoint``: TCP (``TCP_NODELAY``) or unix socket, the TLS
    handshake, ``AUTH`` and ``SELECT``, all within ``min(connect_timeout_s, deadline)``.

    Raises:
        TierTimeoutError: the connect or handshake passed its time.
        TierUnavailableError: refused, unreachable, TLS failure (the reason named), or the
            credentials were refused ("authentication failed").
    """
    limit = min(deadline, time.monotonic() + endpoint.connect_timeout_s)
    if limit - time.monotonic() <= 0:
        raise TierTimeoutError(f"server {endpoint.address}: no time left to connect")
    sock = _open_socket(endpoint, limit)
    conn = Connection(sock, endpoint)
    try:
        _handshake(conn, endpoint, deadline)
    except BaseException:
        conn.close()
        raise
    return conn


def _open_socket(endpoint: Endpoint, limit: float) -> socket.socket:
    """The connected (and TLS-wrapped) socket, by ``limit`` (``time.monotonic()`` seconds).

    Raises:
        TierTimeoutError, TierUnavailableError: as ``connect``.
    """
    where = f"server {endpoint.address}"
    sock: socket.socket | None = None
    try:
        if endpoint.unix_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(max(1e-3, limit - time.monotonic()))
            sock.connect(endpoint.unix_path)
        else:
            left = max(1e-3, limit - time.monotonic())
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
        raise TierUnavailableError(f"{where}: TLS handshake failed: {ssl_reason(exc)}") from None
    except OSError as exc:
        _close(sock)
        reason = exc.strerror or type(exc).__name__
        raise TierUnavailableError(f"{where}: connect failed: {reason}") from None
    return sock


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
