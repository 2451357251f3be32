"""Host-side boundary gate of the DeepSeek-V4 c128 compressor (numpy only: no torch, no Triton).

Offers:
    c128_boundary   does any request of a step complete a 128-token window?
    C128_RATIO      the compress ratio, 128

A request that computes positions ``start .. start + qlen - 1`` completes a window iff one of
them is a boundary, ``(pos + 1) % 128 == 0``, that is iff ``start % 128 + qlen >= 128``. The
step hook (:mod:`kvmgr.kernels.c128.hook`) skips the compress launch when the answer is exactly
``False`` and the step is not being captured into a CUDA graph.
"""

from __future__ import annotations

import itertools

import numpy as np

from kvmgr.errors import GeometryError
from kvmgr.kernels.c128.checks import fail
from kvmgr.kernels.c128.layout import C128_RATIO

__all__ = ["C128_RATIO", "c128_boundary"]

_GATE_SCAN_MAX = 32  # up to this many requests a Python scan beats numpy's per-call cost
_NDARRAY = np.ndarray
_WIDE_INTS = frozenset({np.dtype(np.int32), np.dtype(np.int64)})


def c128_boundary(
    num_computed_tokens: np.ndarray | None, query_start_loc: np.ndarray | None
) -> bool | None:
    """Whether some request completes a 128-token window in this step (host only, no device).

    Request ``r`` computes positions ``start .. start + qlen - 1`` with
    ``start = num_computed_tokens[r]`` and ``qlen = query_start_loc[r+1] - query_start_loc[r]``;
    it crosses a boundary iff ``start % 128 + qlen >= 128``.

    Cost: one compare for one request, no allocation beyond two small lists for up to 32
    requests (a Python scan), a few
    numpy operations above that; arrays that are not 1-D signed-integer numpy arrays are
    converted first (slower, same answer).

    Args:
        num_computed_tokens: host int array ``[num_reqs]`` (>= 0), or ``None`` when unknown.
        query_start_loc: host int array ``[num_reqs + 1]``, non-decreasing, or ``None``.

    Returns:
        True or False; ``None`` when either input is ``None`` (callers must then not skip).

    Raises:
        GeometryError: the arrays are not 1-D integer host arrays of matching lengths, or a
            count is negative.
    """
    if num_computed_tokens is None or query_start_loc is None:
        return None
    start, loc = num_computed_tokens, query_start_loc
    if not (
        type(start) is _NDARRAY
        and type(loc) is _NDARRAY
        and start.ndim == 1
        and loc.ndim == 1
        and start.dtype in _WIDE_INTS  # int32/int64: no overflow in the sums below
        and loc.dtype in _WIDE_INTS
    ):
        start = _host_ints(num_computed_tokens, "num_computed_tokens")
        loc = _host_ints(query_start_loc, "query_start_loc")
    num_reqs = len(start)  # 1-D arrays: len() is the cheapest read of the length
    if len(loc) != num_reqs + 1:
        raise fail("query_start_loc", f"length {num_reqs + 1}", len(loc))
    if num_reqs == 1:  # a batch-1 step: one compare
        first, (begin, end) = start.item(0), loc.tolist()
        if first < 0 or end < begin:
            raise _bad_counts([first], [end - begin])
        return first % C128_RATIO + end - begin >= C128_RATIO
    if num_reqs <= _GATE_SCAN_MAX:
        starts, locs = start.tolist(), loc.tolist()
        crosses, prev = False, locs[0]
        for first, end in zip(starts, locs[1:]):  # every request checked before answering
            qlen, prev = end - prev, end
            if first < 0 or qlen < 0:
                raise _bad_counts(starts, [b - a for a, b in itertools.pairwise(locs)])
            if first % C128_RATIO + qlen >= C128_RATIO:
                crosses = True
        return crosses
    qlen = loc[1:] - loc[:-1]
    if (start | qlen).min() < 0:  # the sign bit of either
        raise _bad_counts(start.tolist(), qlen.tolist())
    return bool(((start & (C128_RATIO - 1)) + qlen).max() >= C128_RATIO)


def _bad_counts(starts: list[int], qlens: list[int]) -> GeometryError:
    return fail("num_computed_tokens / query_start_loc steps", "values >= 0", (starts, qlens))


def _host_ints(a: object, name: str) -> np.ndarray:
    """``a`` as a 1-D int64 host array (lists, other int dtypes, CPU tensors are converted)."""
    device = getattr(a, "device", None)  # a torch tensor; numpy 2 arrays say "cpu"
    if device is not None and getattr(device, "type", device) != "cpu":
        raise fail(name, "a host array", f"a tensor on {device}")
    arr = np.asarray(a)
    if arr.ndim == 1 and arr.size == 0:  # np.asarray([]) is float64
        return arr.astype(np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise fail(name, "a 1-D integer array", f"{arr.ndim}-D {arr.dtype}")
    return arr.astype(np.int64, copy=False)
