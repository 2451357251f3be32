"""``kvmgr bench tiers``: store/load throughput of the disk and shared tiers, beside their ceilings.

Offers:
    add_arguments, run, run_tiers_bench   the CLI entry points
    CASES                                 block geometries (page bytes x tensors)

CPU only. For each case (``4k48``: 48 tensors of 4 KiB pages, 192 KiB a block; ``32k64``: 64 of
32 KiB, 2 MiB a block) and each tier, ``--steps`` step-batches of ``--batch-mib`` MiB go through
``TierBridge.demote`` (gather the pages from CPU tensors, checksum, write) and then the same keys
through ``TierBridge.promote`` (read, verify, scatter into other CPU blocks), one batch in flight
at a time, after one warm-up batch. Bytes = blocks x block payload bytes; GB/s = bytes / total
seconds / 1e9; p50/p99 over the per-batch times. The loaded bytes are checked against the source.

Ceilings, in the same run:
    shared: the server's own benchmark tool (``valkey-benchmark``/``redis-benchmark``) with the
        same value size (the blob bytes), one connection pipelining one batch (``-c 1 -P B``);
        ratio = our blocks/s / its requests/s.
    disk: a ``dd``-style sequential write (then read) of one step's blob bytes in 8 MiB chunks
        after each tier step, with the tier's own open mode (``O_DIRECT`` when the tier got it);
        ratio = our GB/s / raw GB/s, both in blob bytes.
    The server's tool runs before and after the tier's steps (mean of the two), the raw disk I/O
    step by step, so tier and ceiling see the same load on a shared machine.
Targets (issue 16): both ratios >= 0.7.

Without ``--url`` a server from PATH is started on a free loopback port (persistence off) and
stopped after; ``--disk-dir`` defaults to a temporary directory on the current filesystem.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvmgr.pool.host_pool import HostKVPool
from kvmgr.tiers import DiskTier, TierBridge, TierNamespace

__all__ = ["CASES", "add_arguments", "run", "run_tiers_bench"]

#: case name -> (page bytes, tensors)
CASES = {"4k48": (4096, 48), "32k64": (32768, 64)}
_CHUNK = 8 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvmgr bench tiers``."""
    parser.add_argument(
        "--cases", nargs="+", default=list(CASES), choices=list(CASES), help="block geometries"
    )
    parser.add_argument(
        "--tiers",
        nargs="+",
        default=["disk", "shared"],
        choices=["disk", "shared"],
        help="tiers to measure",
    )
    parser.add_argument("--batch-mib", type=float, default=24.0, help="payload MiB per step-batch")
    parser.add_argument("--steps", type=int, default=12, help="timed step-batches per direction")
    parser.add_argument("--url", default=None, help="server URL (default: start one on loopback)")
    parser.add_argument("--disk-dir", default=None, help="directory of the disk tier's file")
    parser.add_argument("--buffered", action="store_true", help="disk tier without O_DIRECT")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print the table; returns 0, or 1 if loaded bytes differed."""
    return run_tiers_bench(args)


def run_tiers_bench(args: argparse.Namespace) -> int:
    """``kvmgr bench tiers`` (see the module docstring); returns the exit status."""
    server = None
    url = args.url
    if "shared" in args.tiers and url is None:
        server = _LocalServer()
        url = server.url
    tmp = tempfile.TemporaryDirectory(dir=args.disk_dir or ".", prefix="kvmgr-bench-tiers-")
    rows: list[dict[str, Any]] = []
    ok = True
    try:
        for case in args.cases:
            for tier in args.tiers:
                result = asyncio.run(_bench_case(case, tier, args, url, Path(tmp.name)))
                ok &= result.pop("verified")
                rows.extend(result["rows"])
    finally:
        tmp.cleanup()
        if server is not None:
            server.stop()
    _print(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if ok else 1


async def _bench_case(
    case: str, tier_name: str, args: argparse.Namespace, url: str | None, tmp: Path
) -> dict[str, Any]:
    page, num_tensors = CASES[case]
    ns = TierNamespace("bench", (page,) * num_tensors, ("uint8",) * num_tensors, 16)
    batch = max(1, int(args.batch_mib * (1 << 20)) // ns.payload_bytes)
    # the CPU tier as the manager has it: one HostKVPool region, random bytes
    pool = HostKVPool((page,) * num_tensors, 2 * batch, lambda n: torch.empty(n, dtype=torch.uint8))
    gen = torch.Generator().manual_seed(0)
    pool.region.copy_(torch.randint(0, 256, (pool.num_bytes,), dtype=torch.uint8, generator=gen))
    cpu = pool.tensors
    total_blocks = batch * (args.steps + 1)
    if tier_name == "disk":
        backend: Any = DiskTier(tmp / f"{case}.bin", slot_bytes=ns.blob_bytes,
                                num_slots=total_blocks, direct=not args.buffered)  # fmt: skip
    else:
        from kvmgr.tiers import SharedTier

        backend = SharedTier(url, deadline_s=60.0, single_tenant=True)  # type: ignore[arg-type]
        _flush(str(url))
    bridge = TierBridge(cpu, backend, ns)
    src, dst = np.arange(batch), np.arange(batch, 2 * batch)
    batches = [[f"{case}-{s}-{i}".encode() for i in range(batch)] for s in range(args.steps + 1)]
    # ceilings measured interleaved with the tier, so both see the same machine: the disk's raw
    # sequential I/O step by step, the server's own tool before and after the tier's run
    raw = _RawDisk(tmp / f"{case}.raw", batch * ns.blob_bytes, args.steps, backend.is_direct) \
        if tier_name == "disk" else None  # fmt: skip
    rps_runs: list[dict[str, float]] = []
    if raw is None:
        rps_runs.append(_server_benchmark(str(url), ns.blob_bytes, batch, args.steps * batch))
    store_s, load_s, raw_write_s, raw_read_s = [], [], [], []
    verified = True
    for step, keys in enumerate(batches):
        t0 = time.perf_counter()
        stored = await bridge.demote(keys, src)
        t1 = time.perf_counter()
        verified &= bool(stored.all())
        if step:
            store_s.append(t1 - t0)
            if raw is not None:
                raw_write_s.append(raw.write(step - 1))
    for step, keys in enumerate(batches):
        t0 = time.perf_counter()
        hit = await bridge.promote(keys, dst)
        t1 = time.perf_counter()
        verified &= bool(hit.all())
        if step:
            load_s.append(t1 - t0)
            if raw is not None:
                raw_read_s.append(raw.read(step - 1))
    if raw is not None:
        raw.close()
    else:
        rps_runs.append(_server_benchmark(str(url), ns.blob_bytes, batch, args.steps * batch))
    verified &= all(torch.equal(t[:batch], t[batch:]) for t in cpu)
    mode = backend.statistics().io_mode
    await backend.aclose()
    block_bytes = ns.payload_bytes
    rows: list[dict[str, Any]] = []
    for direction, times in (("store", store_s), ("load", load_s)):
        total = sum(times)
        rows.append({
            "case": case, "tier": f"{tier_name} ({mode})", "direction": direction,
            "batch_blocks": batch, "gbps": len(times) * batch * block_bytes / total / 1e9,
            "blocks_per_s": len(times) * batch / total,
            "p50_ms": float(np.percentile(times, 50) * 1e3),
            "p99_ms": float(np.percentile(times, 99) * 1e3),
        })  # fmt: skip
    if raw is not None:
        for row, key, times in zip(rows, ("write", "read"), (raw_write_s, raw_read_s)):
            raw_gbps = len(times) * raw.step_bytes / sum(times) / 1e9
            row["ceiling"] = f"dd {key} {raw_gbps:.2f} GB/s"
            row["ratio"] = row["gbps"] * ns.blob_bytes / block_bytes / raw_gbps
    else:
        for row, key in zip(rows, ("SET", "GET")):
            runs = [r[key] for r in rps_runs if key in r]
            if runs:
                rps = sum(runs) / len(runs)
                row["ceiling"] = f"{key} -P {batch} {rps * ns.blob_bytes / 1e9:.2f} GB/s"
                row["ratio"] = row["blocks_per_s"] / rps
    return {"rows": rows, "verified": verified}


def _flush(url: str) -> None:
    """Empty the benchmark's server (``FLUSHALL``) before a case."""
    import redis

    client = redis.Redis.from_url(url.replace("+cluster", ""))
    try:
        client.flushall()
    finally:
        client.close()


class _RawDisk:
    """``dd``-style sequential I/O of one step's bytes at a time, in 8 MiB chunks, one file."""

    def __init__(self, path: Path, step_bytes: int, steps: int, direct: bool) -> None:
        self.path = path
        self.chunks = -(-step_bytes // _CHUNK)
        self.step_bytes = self.chunks * _CHUNK
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        self.fd = os.open(path, flags, 0o600)
        os.posix_fallocate(self.fd, 0, self.step_bytes * steps)
        self.buf = mmap.mmap(-1, _CHUNK)
        self.buf.write(os.urandom(_CHUNK))

    def write(self, step: int) -> float:
        """Seconds to write step ``step``'s bytes sequentially."""
        t0 = time.perf_counter()
        for i in range(self.chunks):
            os.pwrite(self.fd, self.buf, step * self.step_bytes + i * _CHUNK)
        return time.perf_counter() - t0

    def read(self, step: int) -> float:
        """Seconds to read step ``step``'s bytes sequentially."""
        t0 = time.perf_counter()
        for i in range(self.chunks):
            os.preadv(self.fd, [self.buf], step * self.step_bytes + i * _CHUNK)
        return time.perf_counter() - t0

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink()


def _server_benchmark(url: str, value_bytes: int, pipeline: int, requests: int) -> dict[str, float]:
    """Requests/s of the server's own tool, pipelined SET and GET; ``{}`` if it is missing."""
    tool = shutil.which("valkey-benchmark") or shutil.which("redis-benchmark")
    parts = urllib.parse.urlsplit(url)
    if tool is None or parts.password:
        return {}
    cmd = [tool, "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379),
           "-t", "set,get", "-d", str(value_bytes), "-n", str(requests), "-c", "1",
           "-P", str(pipeline), "--csv"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    rps = {}
    for line in out.splitlines()[1:]:
        fields = [f.strip('"') for f in line.split(",")]
        rps[fields[0]] = float(fields[1])
    return rps


class _LocalServer:
    """A throwaway ``valkey-server``/``redis-server`` on a free loopback port."""

    def __init__(self) -> None:
        binary = shutil.which("valkey-server") or shutil.which("redis-server")
        if binary is None:
            raise SystemExit("kvmgr bench tiers: no valkey-server/redis-server on PATH "
                             "(apt-get install -y redis-server), or pass --url")  # fmt: skip
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.dir = tempfile.TemporaryDirectory(prefix="kvmgr-bench-server-")
        self.process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", self.dir.name, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{port}/0"
        for _ in range(500):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                return
            except OSError:
                time.sleep(0.01)
        raise SystemExit("kvmgr bench tiers: the server did not start")

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(10)
        self.dir.cleanup()


def _print(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvmgr bench tiers (payload GB/s; ceiling in blob bytes)")
    cols = ["case", "tier", "dir", "blocks/batch", "GB/s", "blocks/s", "p50 ms", "p99 ms",
            "ceiling", "ratio"]  # fmt: skip
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(
            r["case"], r["tier"], r["direction"], str(r["batch_blocks"]), f"{r['gbps']:.2f}",
            f"{r['blocks_per_s']:.0f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
            r.get("ceiling", "-"), f"{r['ratio']:.2f}" if "ratio" in r else "-",
        )  # fmt: skip
    Console(width=140).print(table)
