"""``kvmgr bench ranks``: what tensor-parallel ranks in their own processes cost the scheduler.

Moves the same KV cache (``--heads`` KV heads, split evenly across the ranks: each rank holds
1/N of every page, the GQA layout) with 1 rank in process (``OffloadManager``, the baseline)
and with N rank processes (``OffloadManager.over_ranks`` over a ``kvmgr.transport.RankGroup``).
One round = ``store_many`` of ``--blocks`` fresh keys + ``step()`` + awaiting the store, then
``load_many`` of them into other blocks + ``step()`` + awaiting the load. Reported per
variant, medians over ``--rounds`` rounds after ``--warmup``:

- ``step_us``: the scheduler's host time inside ``step()`` (``StepReport.host_s``): bookkeeping,
  plan or frame building, submission or the writes to every rank's pipe;
- ``job_us``: from ``step()`` to the job's future resolving (the copy plus the transport);
  ``added_us`` is the difference to the in-process baseline of the same device;
- ``GB/s``: bytes moved across all ranks per second of ``job_us`` (round trip of the store and
  the load; formula ``2 * blocks * block_bytes_all_ranks / (store_s + load_s)``).

``--device cuda``: each rank's KV tensors live on ``cuda:0`` (all ranks on the one GPU: the data
path of TP=N on a single device) with the engine ``--engine``; the CPU tier is pinned by it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvmgr.bench._options import int_list, positive_int

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ranks", type=int_list, default="1,2,4", help="comma-separated rank counts"
    )
    parser.add_argument("--heads", type=int, default=8, help="KV heads, split across ranks")
    parser.add_argument("--layers", type=int, default=8, help="KV tensors (K and V per layer)")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per block")
    parser.add_argument("--head-dim", type=int, default=128, help="elements per head (fp16)")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per store and per load")
    parser.add_argument("--rounds", type=positive_int, default=50, help="timed rounds per variant")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu: CPU tensors and the host engine; cuda: each rank holds its share of the KV heads on the one GPU",
    )
    parser.add_argument("--engine", default="auto", help="engine for --device cuda")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def bench_rank(rank: int, num_ranks: int, spec: dict[str, Any]) -> Any:
    """The ``RankGroup`` factory: this rank's share of the heads, random fp16 bytes."""
    import torch

    from kvmgr.transfer import HostEngine, make_engine
    from kvmgr.worker import TransferWorker

    kv = _kv(spec, rank, num_ranks)
    if spec["device"] == "cpu":
        engine: Any = HostEngine()
    else:
        engine = make_engine(spec["engine"], torch.device("cuda:0"))
    return TransferWorker(kv, spec["num_cpu_blocks"], engine, rank=rank, num_ranks=num_ranks)


def _kv(spec: dict[str, Any], rank: int, num_ranks: int) -> list[Any]:
    import torch

    heads = spec["heads"] // num_ranks
    shape = (spec["num_gpu_blocks"], spec["block_size"], heads, spec["head_dim"])
    gen = torch.Generator().manual_seed(1000 + rank)
    device = torch.device("cuda:0" if spec["device"] == "cuda" else "cpu")
    return [
        torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.float16).to(device)
        for _ in range(2 * spec["layers"])
    ]


async def _rounds(mgr: Any, spec: dict[str, Any], rounds: int, warmup: int) -> dict[str, Any]:
    n = spec["blocks"]
    src = np.arange(n, dtype=np.int64)
    dst = np.arange(n, 2 * n, dtype=np.int64)
    step_us, job_us, bytes_moved = [], [], []
    for r in range(warmup + rounds):
        keys = [b"r%06d-%05d" % (r, i) for i in range(n)]
        times = []
        for call in ("store", "load"):
            future = mgr.store_many(src, keys) if call == "store" else mgr.load_many(keys, dst)
            start = time.perf_counter()
            report = await mgr.step()
            await future
            times.append((report.host_s, time.perf_counter() - start, report))
        mgr.invalidate(keys)
        if r >= warmup:
            step_us += [t[0] * 1e6 for t in times]
            job_us += [t[1] * 1e6 for t in times]
            bytes_moved.append(
                (times[0][2].d2h.bytes + times[1][2].h2d.bytes, times[0][1] + times[1][1])
            )
    moved = sum(b for b, _ in bytes_moved)
    seconds = sum(s for _, s in bytes_moved)
    return {
        "step_us_p50": statistics.median(step_us),
        "job_us_p50": statistics.median(job_us),
        "job_us_min": min(job_us),
        "gbps": moved / seconds / 1e9,
    }


def _variant(num_ranks: int, spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from kvmgr.config import ManagerConfig
    from kvmgr.manager import OffloadManager

    config = ManagerConfig(
        num_cpu_blocks=spec["num_cpu_blocks"],
        engine="host" if spec["device"] == "cpu" else spec["engine"],
        manage_gpu_blocks=False,
    )
    if num_ranks == 1:  # the baseline: one rank, in process

        async def local() -> dict[str, Any]:
            worker_kv = _kv(spec, 0, 1)
            async with OffloadManager(worker_kv, config) as mgr:
                return await _rounds(mgr, spec, args.rounds, args.warmup)

        return {"ranks": 1, "transport": "in process", **asyncio.run(local())}
    from kvmgr.transport import RankGroup

    group = RankGroup(num_ranks, bench_rank, (spec,), deadline_s=120)
    try:

        async def ranked() -> dict[str, Any]:
            mgr = OffloadManager.over_ranks(group, config)
            try:
                return await _rounds(mgr, spec, args.rounds, args.warmup)
            finally:
                await mgr.aclose()

        return {"ranks": num_ranks, "transport": "pipes", **asyncio.run(ranked())}
    finally:
        group.close()


def run(args: argparse.Namespace) -> int:
    ranks = args.ranks
    if any(args.heads % r for r in ranks):
        print(f"kvmgr bench ranks: error: --heads {args.heads} must split evenly", file=sys.stderr)
        return 2
    spec = {
        "num_gpu_blocks": 2 * args.blocks,
        "num_cpu_blocks": 2 * args.blocks,
        "blocks": args.blocks,
        "heads": args.heads,
        "layers": args.layers,
        "block_size": args.block_size,
        "head_dim": args.head_dim,
        "device": args.device,
        "engine": args.engine,
    }
    block_bytes = 2 * args.layers * args.block_size * args.heads * args.head_dim * 2
    results = [_variant(r, spec, args) for r in ranks]
    base = next((r for r in results if r["ranks"] == 1), None)
    lines = [
        f"KV block: {block_bytes} B over all ranks ({args.heads} heads x {args.layers} layers, "
        f"fp16), {args.blocks} blocks per job, device {args.device}",
        "",
        "| ranks | transport | step() host us p50 | job us p50 | added us vs 1 rank | GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        added = "" if base is None else f"{r['job_us_p50'] - base['job_us_p50']:+.0f}"
        r["added_us_p50"] = None if base is None else r["job_us_p50"] - base["job_us_p50"]
        lines.append(
            f"| {r['ranks']} | {r['transport']} | {r['step_us_p50']:.0f} | "
            f"{r['job_us_p50']:.0f} | {added} | {r['gbps']:.2f} |"
        )
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"block_bytes": block_bytes, "spec": spec, "results": results}, f, indent=1)
    return 0
