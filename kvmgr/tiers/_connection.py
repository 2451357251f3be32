"""Connection settings of the shared tier: URL schemes, credentials kept out of sight, TLS.

Offers (to ``kvmgr.tiers.shared`` only):
    Secret          a string whose repr/str never shows it
    ServerAddress   the URL without credentials, the servers, username and password (Secret)
    parse_address   read a URL and the credential sources (URL, file, environment variable)
    tls_context     the client's ``ssl.SSLContext`` (CA bundle, client certificate, hostname check)
    endpoint_for    the first server's ``Endpoint`` (with its TLS context)
    check_limits    ``ConfigError`` for a limit that is not a finite number > 0

URLs: ``redis://[user[:password]@]HOST[:PORT][/DB]``, ``rediss://`` (TLS), ``valkey://`` and
``valkeys://`` (the same), ``unix://[user[:password]@]/PATH[?db=N]``, and for a cluster
``redis+cluster://HOST:PORT[,HOST:PORT...]`` (also ``rediss+``, ``valkey+``, ``valkeys+``): seed
nodes, from which the cluster's map is read. The password may contain any character, ``@ / ? #
:`` included: it ends at the last ``@`` (percent-encoding works too). Query options: ``db``,
``username``, ``password``. TLS settings are constructor arguments, never URL options: a
``?ssl_cert_reqs=none`` that silently turned verification off is refused (issue 26). No error
message contains the URL as given (it may hold the password).
"""

from __future__ import annotations

import math
import os
import ssl
import urllib.parse
from pathlib import Path
from typing import Any

import attrs

from kvmgr.errors import ConfigError
from kvmgr.tiers._resp import Endpoint

__all__ = [
    "SCHEMES",
    "Secret",
    "ServerAddress",
    "check_limits",
    "endpoint_for",
    "parse_address",
    "tls_context",
]

#: accepted URL schemes -> (TLS, cluster): redis, rediss, valkey, valkeys (each +cluster), unix
SCHEMES = {
    f"{name}{'s' * tls}{'+cluster' * cluster}": (tls, cluster)
    for name in ("redis", "valkey")
    for tls in (False, True)
    for cluster in (False, True)
} | {"unix": (False, False)}
_QUERY = ("db", "username", "password")


class Secret:
    """A credential: ``reveal()`` gives it; ``repr``/``str``/formatting give ``'***'``."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The secret itself (only for the ``AUTH`` command)."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return "***"

    def __reduce__(self) -> tuple[object, ...]:  # never pickle a credential into a report
        raise TypeError("Secret cannot be pickled")


@attrs.frozen
class ServerAddress:
    """Where the servers are and who we are.

    Attributes:
        url: the URL as the tier reports it: scheme normalised (``redis``, ``rediss``,
            ``unix``, ``redis+cluster``, ``rediss+cluster``), no credentials.
        servers: ``(host, port)`` of the server, or the cluster's seed nodes.
        unix_path: the socket path of a ``unix://`` URL, else ``None``.
        db: database index (0 for a cluster).
        is_tls, is_cluster: from the scheme.
        username: ACL user, or ``None`` (the server's ``default`` user).
        password: ``Secret`` or ``None``.
        password_source: ``"url"``, ``"file"``, ``"env"`` or ``None`` (for reports).
    """

    url: str
    servers: tuple[tuple[str, int], ...]
    unix_path: str | None
    db: int
    is_tls: bool
    is_cluster: bool
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
    """Split ``url`` into servers, options and credentials (see the module docstring).

    Password, first found: the URL's, then ``password_file`` (its first line, stripped), then
    the environment variable ``password_env``. Username: the URL's, else ``username``.

    Raises:
        ConfigError: not a str, unknown scheme, no host, a bad port or db, an unknown or TLS
            query option, or an unreadable password file (the message names the file, never
            its content). No message shows the URL's credentials.
    """
    if not isinstance(url, str):
        raise ConfigError(f"tier URL: expected a str, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        shown = scheme.lower() if sep else "(none)"
        raise ConfigError(f"tier URL: expected scheme in {sorted(SCHEMES)}, got {shown!r}")
    scheme = scheme.lower()
    is_tls, is_cluster = SCHEMES[scheme]
    userinfo, at, rest = rest.rpartition("@")  # the password may hold any character but "@"...
    url_user, url_password = _userinfo(userinfo) if at else (None, None)  # ...the last ends it
    location, _, query = rest.partition("?")
    options = _query(query)
    url_user = url_user or options.get("username")
    url_password = options.get("password") if url_password is None else url_password
    servers, unix_path, db = _locate(scheme, location, options, is_cluster)
    password, source = _password(url_password, password_file, password_env)
    clean = _clean_url(servers, unix_path, db, is_tls, is_cluster)
    user = (url_user or username) or None
    return ServerAddress(clean, servers, unix_path, db, is_tls, is_cluster, user, password, source)


def _clean_url(
    servers: tuple[tuple[str, int], ...], unix_path: str | None, db: int, tls: bool, cluster: bool
) -> str:
    """The URL as the tier reports it: scheme normalised, no credentials."""
    if unix_path is not None:
        return f"unix://{unix_path}" + (f"?db={db}" if db else "")
    hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in servers)
    scheme = ("rediss" if tls else "redis") + ("+cluster" if cluster else "")
    return f"{scheme}://{hosts}" + ("" if cluster else f"/{db}")


def _locate(
    scheme: str, location: str, options: dict[str, str], is_cluster: bool
) -> tuple[tuple[tuple[str, int], ...], str | None, int]:
    """``(servers, unix_path, db)`` of a URL's location (the part before ``?``)."""
    if scheme == "unix":
        if not location.startswith("/"):
            raise ConfigError("tier URL: expected unix:///absolute/path.sock")
        return (), location, _db(options.get("db", "0"))
    hosts, _, path = location.partition("/")
    servers = tuple(_host_port(h) for h in hosts.split(",")) if hosts else ()
    if not servers:
        raise ConfigError("tier URL: expected a host (redis://HOST:PORT/DB)")
    if len(servers) > 1 and not is_cluster:
        raise ConfigError("tier URL: several hosts need a cluster scheme (redis+cluster://)")
    db = _db(options.get("db", path or "0"))
    if is_cluster and db:
        raise ConfigError(f"tier URL: a cluster has only db 0, got {db}")
    return servers, None, db


def _userinfo(text: str) -> tuple[str | None, str | None]:
    user, colon, password = text.partition(":")
    return (urllib.parse.unquote(user) or None, urllib.parse.unquote(password) if colon else None)


def _query(query: str) -> dict[str, str]:
    options = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
    for name in options:
        if name.startswith("ssl") or name.startswith("tls"):
            raise ConfigError(
                f"tier URL: TLS option {name!r} is not read from the URL; pass ssl_ca_certs=, "
                "ssl_certfile=, ssl_keyfile=, ssl_check_hostname= to SharedTier"
            )
        if name not in _QUERY:
            raise ConfigError(f"tier URL: unknown option {name!r} (expected one of {_QUERY})")
    return options


def _host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, port_text = text[1:].partition("]")
        port_text = port_text.removeprefix(":")
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ConfigError("tier URL: expected a host (redis://HOST:PORT/DB)")
    if not port_text:
        return host, 6379
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"tier URL: expected a port in 1..65535, got {port_text[:8]!r}")
    return host, int(port_text)


def _db(text: str) -> int:
    if not text.isdigit():
        raise ConfigError(f"tier URL: expected a database number, got {text[:8]!r}")
    return int(text)


def _password(
    url_password: str | None,
    password_file: str | os.PathLike[str] | None,
    password_env: str | None,
) -> tuple[Secret | None, str | None]:
    if url_password is not None:
        return Secret(url_password), "url"
    if password_file is not None:
        try:
            first = Path(password_file).read_text().splitlines()
        except OSError as exc:
            raise ConfigError(
                f"tier password file {os.fspath(password_file)!r}: {exc.strerror}"
            ) from None
        return Secret(first[0].strip() if first else ""), "file"
    if password_env and os.environ.get(password_env):
        return Secret(os.environ[password_env]), "env"
    return None, None


def tls_context(
    ca_certs: str | None,
    certfile: str | None,
    keyfile: str | None,
    check_hostname: bool,
) -> ssl.SSLContext:
    """A client TLS context: the CA bundle (``None``: the system store), an optional client
    certificate (mutual TLS), certificate verification always on, hostname check as asked.

    Raises:
        ConfigError: a file that cannot be read or a key that does not match the certificate.
    """
    try:
        context = ssl.create_default_context(cafile=ca_certs)
        context.check_hostname = check_hostname
        if certfile is not None:
            context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
        raise ConfigError(f"SharedTier TLS files: {reason}") from None
    return context


def endpoint_for(
    address: ServerAddress,
    tls_files: tuple[str | None, str | None, str | None],
    check_hostname: bool,
    connect_timeout_s: float,
) -> Endpoint:
    """The first server's ``Endpoint`` (TLS context built from the CA, certificate and key
    files when the URL asks for TLS).

    Raises:
        ConfigError: TLS files with a plain URL, or unreadable ones.
    """
    if not address.is_tls and any(a is not None for a in tls_files):
        raise ConfigError(
            "SharedTier: TLS arguments (ssl_ca_certs, ssl_certfile, ssl_keyfile) given with "
            f"the plain URL {address.url}: use rediss:// (or valkeys://) for TLS"
        )
    context = tls_context(*tls_files, check_hostname) if address.is_tls else None
    host, port = address.servers[0] if address.servers else ("", 0)
    return Endpoint(
        host, port, address.unix_path, context, address.username, address.password,
        address.db, connect_timeout_s,
    )  # fmt: skip


def check_limits(**limits: Any) -> None:
    """Each limit is a float > 0 (a ``(value, True)`` pair may be 0; ``(value, None)`` may be
    ``None``), finite; a ``(value, int)`` pair is an int >= 1.

    Raises:
        ConfigError: a limit that is none of these (the message names it).
    """
    for name, spec in limits.items():
        value, allowed = spec if isinstance(spec, tuple) else (spec, False)
        if value is None and allowed is None:
            continue
        if allowed is int:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"SharedTier: expected {name} an int >= 1, got {value!r}")
            continue
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = ok and math.isfinite(value) and (value > 0 or (allowed is True and value == 0))
        if not ok:
            raise ConfigError(f"SharedTier: expected {name} a finite number > 0, got {value!r}")
