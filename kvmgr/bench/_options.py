"""Command-line options several benchmarks share (private to ``kvmgr.bench``).

Offers:
    add_cases    ``--geometries`` (of a ``GEOMETRIES`` table) and ``--blocks`` (64 and 512)
    add_output   ``--seed`` and ``--json``
    int_list     an argparse ``type``: comma-separated ints >= 1 (``"1,64,512"``)
    positive_int, positive_float   argparse ``type``s: an int >= 1, a finite float > 0
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping

__all__ = ["add_cases", "add_output", "int_list", "positive_float", "positive_int"]


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


def int_list(text: str) -> list[int]:
    """``text`` (``"1,64,512"``) as ``[1, 64, 512]``: an argparse ``type``, so a bad value is
    a usage error naming the option, not a traceback.

    Raises:
        argparse.ArgumentTypeError: not comma-separated ints, none, or one below 1.
    """
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """``text`` as an int >= 1 (counts: rounds, repeats, tokens per block): an argparse
    ``type``, so ``0`` is a usage error naming the option, not a traceback deep in the run.

    Raises:
        argparse.ArgumentTypeError: not an int, or below 1.
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """``text`` as a finite float > 0 (sizes in GiB, seconds): an argparse ``type``.

    Raises:
        argparse.ArgumentTypeError: not a number, ``nan``/``inf``, or not above 0.
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value
