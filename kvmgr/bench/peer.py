"""``kvmgr bench peer``: kvmgr side by side with C++ baselines built after the seed PRs' designs.

Runs both halves in one process, on the GPU machine (they compile with torch's cpp_extension,
which needs nvcc and ninja there):

- the grouped MLA insert against a CUDA kernel with grid (T, L) and one CTA per token, after
  vLLM's ``concat_and_cache_mla_grouped`` (``kvmgr.bench.peer_mla``, options ``--mla-*``);
- swaps against a C++ op calling ``cuMemcpyBatchAsync``, after vLLM's ``swap_blocks_batch``
  (``kvmgr.bench.peer_swap``, options ``--swap-*``).

Each half checks that kvmgr's output bytes equal the baseline's and prints its table with ratios;
the exit status is 1 when bytes differ anywhere, 2 without a GPU.
"""

from __future__ import annotations

import argparse

from kvmgr.bench import peer_mla, peer_swap

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--halves",
        nargs="+",
        choices=("mla", "swap"),
        default=["mla", "swap"],
        help="which comparisons to run",
    )
    peer_mla.add_arguments(parser)
    peer_swap.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    status = 0
    if "mla" in args.halves:
        status = max(status, int(peer_mla.run_peer_mla(args)))
    if "swap" in args.halves and status != 2:
        result = peer_swap.run_peer_swap(args)
        status = max(status, 0 if result["ok"] else 1)
    return status
