"""A real Valkey/Redis server for the shared-tier tests, started per test on a free port.

Fixtures (import them into a test module):
    tier_server        a running ``TierServer`` (persistence off), stopped after the test
    tier_server_factory  start more servers with extra config (maxmemory, ACL users)

Binary: ``valkey-server`` if on PATH, else ``redis-server``. Without either, the tests skip
with a message saying how to install one; with ``KVMGR_REQUIRE_TIER_SERVER=1`` (set by CI) a
missing binary fails them instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmgr.testing.servers import LocalServer

__all__ = [
    "TierServer",
    "make_certs",
    "random_bridge",
    "server_binary",
    "tier_server",
    "tier_server_factory",
    "tls_server",
]

_INSTALL_HINT = (
    "needs valkey-server or redis-server on PATH: `apt-get install -y redis-server` "
    "(Debian/Ubuntu; `valkey-server` where the distribution has it)"
)


def server_binary() -> str:
    """Path of ``valkey-server`` or ``redis-server``; skips (or fails in CI) when absent."""
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found:
        return found
    if os.environ.get("KVMGR_REQUIRE_TIER_SERVER") == "1":
        pytest.fail(f"KVMGR_REQUIRE_TIER_SERVER=1 but the tier server is missing: {_INSTALL_HINT}")
    pytest.skip(_INSTALL_HINT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TierServer(LocalServer):
    """The testing kit's ``LocalServer`` (started on construction; ``kill``/``start``/
    ``freeze``/``thaw``, the port kept) with the credentials a test's setup uses."""

    admin_auth: dict[str, str]

    def command(self, *args: str | bytes) -> object:
        """Run one command on a fresh synchronous connection (for test setup and tampering)."""
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, **self.admin_auth)
        try:
            return client.execute_command(*args)
        finally:
            client.close()


@pytest.fixture
def tier_server_factory(tmp_path: Path) -> Iterator[Callable[..., TierServer]]:
    binary = server_binary()
    started: list[TierServer] = []

    def start(*args: str, admin: dict[str, str] | None = None, tls: bool = False) -> TierServer:
        workdir = tmp_path / f"server{len(started)}"
        workdir.mkdir()
        port = _free_port()
        tls_port = ("--tls-port", str(port)) if tls else ()  # the args turn the plain port off
        server = TierServer(*args, *tls_port, workdir=workdir, binary=binary, port=port)
        server.admin_auth = admin or {}
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def tier_server(tier_server_factory: Callable[..., TierServer]) -> TierServer:
    return tier_server_factory()


def random_cpu_tensors(page_bytes: tuple[int, ...], num_blocks: int, seed: int) -> list[object]:
    """CPU-tier pages as ``HostKVPool.tensors`` gives them: uint8 ``[num_blocks, page]``, random."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (num_blocks, p), dtype=torch.uint8, generator=gen) for p in page_bytes
    ]


def random_bridge(tier: Any, namespace: Any, num_blocks: int, seed: int) -> tuple[list, Any]:
    """``num_blocks`` random CPU blocks of ``namespace``'s pages (``random_cpu_tensors``) and a
    ``TierBridge`` between them and ``tier``: ``(cpu tensors, bridge)``."""
    from kvmgr.tiers import TierBridge

    cpu = random_cpu_tensors(namespace.page_bytes, num_blocks, seed)
    return cpu, TierBridge(cpu, tier, namespace)


def tls_server(
    factory: Callable[..., TierServer], certs: dict[str, str], auth_clients: str
) -> TierServer:
    """A TLS-only server (plain port off) with ``make_certs``' server certificate and CA;
    ``auth_clients``: ``--tls-auth-clients`` (``no``, ``optional``, ``yes``)."""
    return factory(
        "--port", "0", "--tls-auth-clients", auth_clients, "--tls-cert-file", certs["crt"],
        "--tls-key-file", certs["key"], "--tls-ca-cert-file", certs["ca"], tls=True,
    )  # fmt: skip


def make_certs(tmp_path: Path) -> dict[str, str]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, made with
    the openssl CLI (skips without it). Keys: ca, crt, key (server), client_crt, client_key."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    names = ("ca.key", "ca.crt", "s.key", "s.csr", "s.crt", "c.key", "c.csr", "c.crt")
    ca_key, ca, key, csr, crt, ckey, ccsr, ccrt = (str(tmp_path / n) for n in names)
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    sign = ["-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1"]
    for cmd in (
        ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=kvmgr-test-ca"],
        ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, *sign, "-out", crt, "-extfile", str(ext)],
        ["req", *ec, "-keyout", ckey, "-out", ccsr, "-subj", "/CN=kvmgr-client"],
        ["x509", "-req", "-in", ccsr, *sign, "-out", ccrt],
    ):  # fmt: skip
        subprocess.run(["openssl", *cmd], check=True, capture_output=True)
    return {"ca": ca, "crt": crt, "key": key, "client_crt": ccrt, "client_key": ckey}
