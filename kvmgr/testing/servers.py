"""Throwaway Valkey/Redis servers on loopback, for tests and benchmarks of the shared tier.

Offers:
    server_binary   ``valkey-server`` or ``redis-server`` from PATH (``None`` if neither)
    LocalServer     one server on a free port, persistence off; ``kill``/``start``/``freeze``
    LocalCluster    a Valkey/Redis Cluster of ``num_primaries`` primaries with ``replicas`` each,
                    built with ``CLUSTER ADDSLOTSRANGE``/``MEET``/``REPLICATE`` (no redis-cli);
                    ``url`` is its ``redis+cluster://`` seed list; ``kill_primary_of(key)``

Both are context managers and stop every process they started. They are for loopback testing
only (no password, ``protected-mode no``, bound to 127.0.0.1).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["LocalCluster", "LocalServer", "server_binary"]


def server_binary() -> str | None:
    """Path of ``valkey-server`` or ``redis-server``, or ``None``."""
    return shutil.which("valkey-server") or shutil.which("redis-server")


def _free_port(cluster: bool = False) -> int:
    """A free loopback port; ``cluster``: below 55536 with its bus port (+10000) free too."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster:
            return port
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair for a cluster node")


class LocalServer:
    """One server process on 127.0.0.1 (persistence off); ``kill``/``start`` keep the port.

    Args:
        args: extra server arguments (``"--maxmemory", "4mb"``...).
        workdir: its directory (default: a temporary one, removed by ``stop``).
        binary: the server binary (default: ``server_binary()``).

    Raises:
        RuntimeError: no server binary, or it did not start listening within 10 s.
    """

    def __init__(
        self, *args: str, workdir: Path | None = None, binary: str | None = None, port: int = 0
    ) -> None:
        self.binary = binary or server_binary()
        if self.binary is None:
            raise RuntimeError(
                "needs valkey-server or redis-server (apt-get install -y redis-server)"
            )
        self.port = port or _free_port(cluster="--cluster-enabled" in args)
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="kvmgr-server-")
        self.workdir = workdir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.args = list(args)
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the process and wait until it listens."""
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no",
               "--loglevel", "warning", *self.args]  # fmt: skip
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"the server exited: {err[-400:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"the server did not listen on port {self.port}")

    def kill(self) -> None:
        """SIGKILL (a crash; the data is gone)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()  # (SIGKILL also ends a frozen process, without waking it)
            self.process.wait(10)
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None

    def freeze(self) -> None:
        """SIGSTOP: connected clients get no answer."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)

    def client(self) -> Any:
        """A synchronous ``redis.Redis`` on this server (for setup and inspection)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)

    def stop(self) -> None:
        """Kill the process and remove its temporary directory."""
        self.kill()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


class LocalCluster:
    """A cluster on loopback: ``num_primaries`` primaries, each with ``replicas`` replicas.

    Args:
        num_primaries: primaries; the 16384 slots are split evenly among them.
        replicas: replicas per primary.
        node_timeout_ms: ``cluster-node-timeout`` (failover starts after it).
        args: extra arguments for every node.

    ``cluster-require-full-coverage no`` (the other primaries keep serving while one fails
    over) and ``cluster-replica-validity-factor 0`` (a replica may always take over).

    Raises:
        RuntimeError: no server binary, or the cluster did not reach ``cluster_state:ok``.
    """

    def __init__(
        self, num_primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000, *args: str
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvmgr-cluster-")
        self.nodes: list[LocalServer] = []
        try:
            for i in range(num_primaries * (1 + replicas)):
                workdir = Path(self._tmp.name) / f"node{i}"
                workdir.mkdir()
                self.nodes.append(LocalServer(
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(node_timeout_ms),
                    "--cluster-require-full-coverage", "no",
                    "--cluster-replica-validity-factor", "0", *args, workdir=workdir,
                ))  # fmt: skip
            self._build(num_primaries)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def _build(self, num_primaries: int) -> None:
        clients = [n.client() for n in self.nodes]
        try:
            step = 16384 // num_primaries
            for i in range(num_primaries):
                end = 16383 if i == num_primaries - 1 else (i + 1) * step - 1
                clients[i].execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, end)
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            self._wait(lambda: all(_known(c) == len(self.nodes) for c in clients), "meet")
            ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]
            for i in range(num_primaries, len(self.nodes)):
                clients[i].execute_command("CLUSTER", "REPLICATE", ids[i % num_primaries])
            self._wait(lambda: all(_state_ok(c) for c in clients), "cluster_state:ok")
        finally:
            for c in clients:
                c.close()

    @staticmethod
    def _wait(ready: Any, what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except Exception:  # a node still busy joining
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the cluster did not reach {what} within {timeout_s:g} s")

    def primary_of(self, key: bytes) -> LocalServer:
        """The node serving ``key``'s slot now (asked of a live node)."""
        from redis.crc import key_slot

        slot = key_slot(key)
        for node in self.nodes:
            if node.process is None:
                continue
            client = node.client()
            try:
                for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        port = int(primary[1])
                        return next(n for n in self.nodes if n.port == port)
            finally:
                client.close()
        raise RuntimeError(f"no live node owns slot {slot}")

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every live node reports ``cluster_state:ok`` and every slot has a live
        primary (after a failover)."""

        def ok() -> bool:
            live = [n for n in self.nodes if n.process is not None]
            for node in live:
                client = node.client()
                try:
                    if not _state_ok(client):
                        return False
                    ports = {int(s[2][1]) for s in client.execute_command("CLUSTER", "SLOTS")}
                finally:
                    client.close()
                if not ports <= {n.port for n in live}:
                    return False
            return True

        self._wait(ok, "a healthy state", timeout_s)

    def stop(self) -> None:
        """Kill every node and remove the directories."""
        for node in self.nodes:
            node.stop()
        self._tmp.cleanup()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def _known(client: Any) -> int:
    return len(client.execute_command("CLUSTER", "NODES").decode().strip().splitlines())


def _state_ok(client: Any) -> bool:
    return b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO")
