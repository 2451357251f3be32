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
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

__all__ = [
    "TierServer",
    "make_certs",
    "server_binary",
    "tier_server",
    "tier_server_factory",
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


class TierServer:
    """One server process on 127.0.0.1:``port``; ``stop()``/``start()`` keep the port."""

    def __init__(self, binary: str, workdir: Path, args: list[str], tls: bool = False) -> None:
        self.binary = binary
        self.port = _free_port()
        self.tls = tls
        self.workdir = workdir
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None
        self.admin_auth: dict[str, str] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = [
            self.binary,
            "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no",
            "--protected-mode", "no", "--loglevel", "warning", *self.args,
        ]  # fmt: skip
        if self.tls:  # TLS on our port (the args turn the plain port off)
            cmd += ["--tls-port", str(self.port)]
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.workdir
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"tier server exited: {err[-500:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"tier server did not listen on port {self.port}")

    def kill(self) -> None:
        """SIGKILL (a crash, also of a frozen server): the data is gone, the port is free."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None

    def freeze(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a frozen host)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after ``freeze``."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)

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
        server = TierServer(binary, workdir, list(args), tls=tls)
        if admin:
            server.admin_auth = admin
        server.start()
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
