"""``kvmgr bench tiers``: the disk and shared tiers against their ceilings, in one run.

Offers:
    add_arguments, run, run_tiers_bench   the CLI entry points
    CASES                                 block geometries (page bytes x tensors)

CPU only. Cases: ``4k48`` (48 tensors of 4 KiB pages, 192 KiB a block) and ``32k64`` (64 of
32 KiB, 2 MiB a block); batch sizes ``--batches`` (blocks per call, capped at
``--max-batch-mib``). Every figure goes through ``TierBridge.demote`` (store: pages -> blobs ->
tier) and ``TierBridge.promote`` (load: tier -> verified blobs -> other CPU blocks), one call in
flight, fresh keys every round; loaded bytes are compared with the source.

Sections (each a ratio measured in the same process, interleaved round by round):
    shared   SharedTier vs a zero-copy floor client (``kvmgr.bench._floor``: one socket in a
             worker thread, ``MSET`` by ``sendmsg`` from the pages, ``MGET`` by
             ``recvmsg_into`` into them, XXH3 included); ratio = floor time / tier time.
             Target (issue 26): >= 0.8 for both cases at batch >= 16.
    cluster  SharedTier on a local cluster (``--cluster-primaries`` primaries, started here
             unless ``--cluster-url``) vs on one server; ratio = one-server time / cluster time.
    disk     DiskTier vs fio (libaio, the tier's run size and queue depth; ``_tiers_disk``);
             ratio = tier slot bytes/s / fio bytes/s. Target: >= 0.8 at batch >= 16.

Without ``--url`` a server from PATH is started on a free loopback port (persistence off) and
stopped after; ``--disk-dir`` defaults to a temporary directory on the current filesystem.
GB/s = blocks x payload bytes / median seconds / 1e9.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import sys
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

from kvmgr.bench._options import add_output, positive_int
from kvmgr.tiers import TierNamespace

__all__ = ["CASES", "add_arguments", "run", "run_tiers_bench"]

#: case name -> (page bytes, tensors)
CASES = {"4k48": (4096, 48), "32k64": (32768, 64)}
SECTIONS = ("shared", "cluster", "disk")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvmgr bench tiers``."""
    parser.add_argument(
        "--cases", nargs="+", default=list(CASES), choices=list(CASES), help="block geometries"
    )
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS,
                        help="what to measure")  # fmt: skip
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 128],
                        help="blocks per call")  # fmt: skip
    parser.add_argument("--max-batch-mib", type=float, default=256.0,
                        help="skip batch sizes above this many MiB")  # fmt: skip
    parser.add_argument(
        "--rounds", type=positive_int, default=5, help="timed rounds (median reported)"
    )
    parser.add_argument("--url", default=None, help="server URL (default: start one on loopback)")
    parser.add_argument("--cluster-url", default=None,
                        help="redis+cluster:// URL (default: start one on loopback)")  # fmt: skip
    parser.add_argument("--cluster-primaries", type=int, default=3,
                        help="primaries of the local cluster (no replicas)")  # fmt: skip
    parser.add_argument("--disk-dir", default=None, help="directory of the disk tier's file")
    parser.add_argument("--buffered", action="store_true", help="disk tier without O_DIRECT")
    add_output(parser, seed=False)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print the table; returns 0, or 1 if loaded bytes differed."""
    return run_tiers_bench(args)


def run_tiers_bench(args: argparse.Namespace) -> int:
    """``kvmgr bench tiers`` (see the module docstring); returns the exit status: 0, 1 if
    loaded bytes differed, 2 (one line on stderr, nothing run) if ``--disk-dir`` is not a
    directory or a ``--url`` / ``--cluster-url`` server accepts no connection."""
    from kvmgr.testing.servers import LocalCluster, LocalServer, server_binary

    problem = _refusal(args)
    if problem is not None:
        print(f"kvmgr bench tiers: {problem}", file=sys.stderr)
        return 2
    started: list[Any] = []
    url, cluster_url = args.url, args.cluster_url
    if server_binary() is None and (url is None or cluster_url is None):
        dropped = [s for s in ("shared", "cluster") if s in args.sections]
        args.sections = [s for s in args.sections
                         if s == "disk" or (s == "shared" and url) or (s == "cluster" and cluster_url)]  # fmt: skip
        if dropped:
            print(f"kvmgr bench tiers: no valkey-server/redis-server on PATH: skipping {dropped} "
                  "(apt-get install -y redis-server, or pass --url/--cluster-url)")  # fmt: skip
    if {"shared", "cluster"} & set(args.sections) and url is None:
        started.append(LocalServer())
        url = started[-1].url
    if "cluster" in args.sections and cluster_url is None:
        started.append(LocalCluster(args.cluster_primaries, replicas=0))
        cluster_url = started[-1].url
    tmp = tempfile.TemporaryDirectory(dir=args.disk_dir or ".", prefix="kvmgr-bench-tiers-")
    try:
        rows, ok = asyncio.run(_bench(args, url, cluster_url, Path(tmp.name)))
    finally:
        tmp.cleanup()
        for server in started:
            server.stop()
    _print(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": _machine(), "rows": rows}, indent=2))
    return 0 if ok else 1


def _refusal(args: argparse.Namespace) -> str | None:
    """Why the run cannot start (a ``--disk-dir`` that is no directory, a ``--url`` /
    ``--cluster-url`` server a section needs that accepts no connection), or None."""
    if args.disk_dir is not None and not Path(args.disk_dir).is_dir():
        return f"--disk-dir {args.disk_dir!r} is not a directory"
    for flag, given, wanted in (("--url", args.url, {"shared", "cluster"}),
                                ("--cluster-url", args.cluster_url, {"cluster"})):  # fmt: skip
        problem = None if given is None or not wanted & set(args.sections) else _unreachable(given)
        if problem is not None:
            shown = re.sub(r"//[^/]*@", "//***@", given)  # never the URL's password
            return f"{flag} {shown!r}: {problem}"
    return None


async def _bench(
    args: argparse.Namespace, url: str | None, cluster_url: str | None, tmp: Path
) -> tuple[list[dict[str, Any]], bool]:
    from kvmgr.bench._tiers_disk import bench_disk
    from kvmgr.bench._tiers_shared import bench_cluster, bench_floor

    rows: list[dict[str, Any]] = []
    ok = True
    for case in args.cases:
        page, num_tensors = CASES[case]
        ns = TierNamespace("bench", (page,) * num_tensors, ("uint8",) * num_tensors, 16)
        for batch in args.batches:
            if batch * ns.payload_bytes > args.max_batch_mib * (1 << 20):
                continue
            jobs = []
            if "shared" in args.sections:
                parts = urllib.parse.urlsplit(str(url))
                address = (parts.hostname or "127.0.0.1", parts.port or 6379)
                jobs.append(bench_floor(case, ns, batch, str(url), address, args.rounds))
            if "cluster" in args.sections:
                jobs.append(bench_cluster(case, ns, batch, str(url), str(cluster_url),
                                          args.rounds))  # fmt: skip
            if "disk" in args.sections:
                jobs.append(bench_disk(case, ns, batch, tmp, args.rounds, args.buffered))
            for job in jobs:
                new_rows, verified = await job
                rows.extend(new_rows)
                ok &= verified
    return rows, ok


def _unreachable(url: str) -> str | None:
    """Why no TCP connection (5 s) opens to any of ``url``'s hosts (``host:port``, 6379 by
    default; a cluster's seed nodes comma-separated) or to its ``unix://`` socket; ``None``
    when one does (closed at once). The URL's other parts are the tier's to check."""
    import socket

    scheme, _, rest = url.partition("://")
    location = rest.rpartition("@")[2].partition("?")[0]
    errors = []
    try:
        if scheme == "unix":
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(5.0)
                sock.connect(location)
            return None
        for host in location.partition("/")[0].split(","):
            parts = urllib.parse.urlsplit(f"//{host}")
            address = (parts.hostname or "127.0.0.1", parts.port or 6379)
            try:
                socket.create_connection(address, timeout=5.0).close()
                return None
            except OSError as exc:
                errors.append(f"{address[0]}:{address[1]} ({exc.strerror or exc})")
    except (OSError, ValueError) as exc:  # a bad port, a socket path that is no socket
        return f"no server accepts connections there ({exc})"
    return "no server accepts connections at " + ", ".join(errors)


def _machine() -> dict[str, Any]:
    import os

    from kvmgr.bench._tiers_disk import fio_version
    from kvmgr.testing.servers import server_binary

    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "server": server_binary(),
            "fio": fio_version()}  # fmt: skip


def _print(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvmgr bench tiers (payload GB/s; ratio = ceiling time / tier time)")
    cols = ["case", "blocks", "dir", "tier", "GB/s", "p50 ms", "ceiling", "ceiling GB/s", "ratio"]
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(
            r["case"], str(r["batch_blocks"]), r["direction"], r["tier"], f"{r['gbps']:.2f}",
            f"{r['p50_ms']:.1f}", r["ceiling"],
            f"{r['ceiling_gbps']:.2f}" if "ceiling_gbps" in r else "-",
            f"{r['ratio']:.2f}" if "ratio" in r else "-",
        )  # fmt: skip
    Console(width=150).print(table)
