"""Parsing of the ``kvmgr simulate`` count flags (``16M``, ``1M,3M``, ``inf``).

Private to ``kvmgr.sim``: ``cli`` and ``multi_cli`` share it.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["count", "count_list", "finite_count"]

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_UNBOUNDED = ("inf", "unbounded", "none")


def count(text: str) -> int | None:
    """``"16M"`` -> 16,000,000 (decimal K/M/G); ``"inf"`` -> ``None`` (unbounded).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    if text.strip().lower() in _UNBOUNDED:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a count like 4096, 16M or inf, got {text!r}")
    return int(float(match.group(1)) * _SUFFIX[match.group(2).lower()])


def finite_count(text: str) -> int:
    """``count`` without ``inf``, and at least 1 (a capacity that must be preallocated).

    Raises:
        argparse.ArgumentTypeError: not a count >= 1 like 4096 or 50M.
    """
    value = count(text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1 like 4096 or 50M, got {text!r}")
    return value


def count_list(text: str) -> list[int]:
    """``"1M,3M,50M"`` -> ``[1000000, 3000000, 50000000]``.

    Raises:
        argparse.ArgumentTypeError: an empty list, or an item that is no finite count.
    """
    values = [count(part) for part in text.split(",") if part.strip()]
    if not values or any(v is None for v in values):
        raise argparse.ArgumentTypeError(f"expected capacities like 1M,3M,50M, got {text!r}")
    return [v for v in values if v is not None]
