"""Command-line options several benchmarks share (private to ``kvmgr.bench``).

Offers:
    add_cases    ``--geometries`` (of a ``GEOMETRIES`` table) and ``--blocks`` (64 and 512)
    add_output   ``--seed`` and ``--json``
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

__all__ = ["add_cases", "add_output"]


def add_cases(parser: argparse.ArgumentParser, geometries: Mapping[str, object]) -> None:
    """``--geometries`` (names of ``geometries``, all by default) and ``--blocks`` (counts per
    case, 64 and 512 by default)."""
    parser.add_argument(
        "--geometries", nargs="+", choices=sorted(geometries), default=list(geometries)
    )
    parser.add_argument("--blocks", nargs="+", type=int, default=[64, 512])


def add_output(parser: argparse.ArgumentParser, *, seed: bool = True) -> None:
    """``--seed`` (0 by default; not with ``seed=False``) and ``--json PATH``."""
    if seed:
        parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results as JSON")
