"""Connection settings of the shared tier: URL schemes, credentials kept out of sight.

Offers (to ``kvmgr.tiers.shared`` only):
    Secret          a string whose repr/str never shows it
    ServerAddress   the URL without credentials, plus username and password (Secret)
    parse_address   read a URL and the credential sources (URL, file, environment variable)
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

import attrs

from kvmgr.errors import ConfigError

__all__ = ["SCHEMES", "Secret", "ServerAddress", "parse_address"]

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
    user = urllib.parse.unquote(parts.username) if parts.username else username
    password, source = None, None
    if parts.password is not None:
        password, source = Secret(urllib.parse.unquote(parts.password)), "url"
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
    clean = urllib.parse.urlunsplit((scheme, netloc, parts.path, parts.query, ""))
    return ServerAddress(
        url=clean,
        is_tls=scheme == "rediss",
        username=user or None,
        password=password,
        password_source=source,
    )
