"""Connection settings of the shared tier: URL schemes, credentials kept out of sight.

Offers (to ``kvmgr.tiers.shared`` only):
    Secret          a string whose repr/str never shows it
    ServerAddress   the URL without credentials, plus username and password (Secret)
    parse_address   read a URL and the credential sources (URL, file, environment variable)
    large_reads     make a redis.asyncio pool's connections read multi-MiB replies in big pieces
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path
from typing import Any

import attrs

from kvmgr.errors import ConfigError

__all__ = ["SCHEMES", "Secret", "ServerAddress", "large_reads", "parse_address"]

#: bytes an asyncio stream may buffer before it pauses the socket (asyncio's default: 64 KiB,
#: pausing at 128 KiB, which turns one 25 MB MGET reply into hundreds of pause/resume rounds).
STREAM_LIMIT_BYTES = 16 << 20

#: accepted URL schemes -> the scheme the redis client speaks.
SCHEMES = {
    "redis": "redis",
    "rediss": "rediss",
    "valkey": "redis",
    "valkeys": "rediss",
    "unix": "unix",
}


class Secret:
    """A credential: ``reveal()`` gives it; ``repr``/``str``/formatting give ``'***'``."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The secret itself (only for handing to the client library)."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return "***"

    def __reduce__(
        self,
    ) -> tuple[object, ...]:  # never pickle a credential into a report or a cache
        raise TypeError("Secret cannot be pickled")


@attrs.frozen
class ServerAddress:
    """Where the server is and who we are.

    Attributes:
        url: URL the client connects to, scheme normalised, no credentials.
        is_tls: ``rediss``/``valkeys``.
        username: ACL user, or ``None`` (the ``default`` user).
        password: ``Secret`` or ``None``.
        password_source: ``"url"``, ``"file"``, ``"env"`` or ``None`` (for reports).
    """

    url: str
    is_tls: bool
    username: str | None
    password: Secret | None = attrs.field(repr=False)
    password_source: str | None


def parse_address(
    url: str,
    *,
    username: str | None = None,
    password_file: str | os.PathLike[str] | None = None,
    password_env: str | None = "KVMGR_TIER_PASSWORD",
) -> ServerAddress:
    """Split ``url`` into a credential-free URL and credentials.

    Password, first found: the URL's ``user:password@``, then ``password_file`` (its first line,
    stripped), then the environment variable ``password_env``. Username: the URL's, else
    ``username``.

    Raises:
        ConfigError: unknown scheme, no host, or an unreadable password file (the message names
            the file, never its content).
    """
    parts = urllib.parse.urlsplit(url)
    scheme = SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise ConfigError(
            f"tier URL: expected scheme in {sorted(SCHEMES)}, got {parts.scheme or '(none)'!r}"
        )
    if scheme != "unix" and not parts.hostname:
        raise ConfigError("tier URL: expected a host (redis://HOST:PORT/DB)")
    # credentials may also sit in the query (redis-py reads ?password=); take them out of the URL
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    query_creds = {k: v for k, v in query if k in ("username", "password")}
    parts = parts._replace(
        query=urllib.parse.urlencode([(k, v) for k, v in query if k not in query_creds])
    )
    url_user = (
        urllib.parse.unquote(parts.username) if parts.username else query_creds.get("username")
    )
    url_password = (
        urllib.parse.unquote(parts.password)
        if parts.password is not None
        else query_creds.get("password")
    )
    user = url_user or username
    password, source = None, None
    if url_password is not None:
        password, source = Secret(url_password), "url"
    elif password_file is not None:
        try:
            first = Path(password_file).read_text().splitlines()
        except OSError as exc:
            raise ConfigError(
                f"tier password file {os.fspath(password_file)!r}: {exc.strerror}"
            ) from None
        password, source = Secret(first[0].strip() if first else ""), "file"
    elif password_env and os.environ.get(password_env):
        password, source = Secret(os.environ[password_env]), "env"
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    if scheme == "unix":  # (urlunsplit would drop the "//" of a netloc-less URL)
        clean = f"unix://{parts.path}" + (f"?{parts.query}" if parts.query else "")
    else:
        clean = urllib.parse.urlunsplit((scheme, netloc, parts.path, parts.query, ""))
    return ServerAddress(
        url=clean,
        is_tls=scheme == "rediss",
        username=user or None,
        password=password,
        password_source=source,
    )


def large_reads(pool: Any) -> None:
    """Let the connections of ``pool`` (a ``redis.asyncio.ConnectionPool``) buffer 16 MiB.

    ``redis.asyncio`` opens its streams with asyncio's default limit; raising the limit of each
    new connection's ``StreamReader`` (its ``_limit``, read by ``feed_data`` to decide when to
    pause) cut a 25 MB ``MGET`` by ~20% on loopback. If a future asyncio drops the attribute,
    this does nothing.
    """
    base = pool.connection_class

    async def _connect(conn: Any) -> None:
        await base._connect(conn)
        reader = getattr(conn, "_reader", None)
        if reader is not None and isinstance(getattr(reader, "_limit", None), int):
            reader._limit = max(reader._limit, STREAM_LIMIT_BYTES)

    pool.connection_class = type(f"LargeRead{base.__name__}", (base,), {"_connect": _connect})
