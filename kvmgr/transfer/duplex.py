"""Both directions at once: which path copies each direction, and which is issued first.

Offers:
    DuplexChoice    a step's paths per direction, the submission order, the modelled microseconds
    duplex_choice   the cheapest (D2H path, H2D path, order) for a step's two batches, over the
                    paths ``"dma"``, ``"kernel"`` and (where the caller can stage) ``"staged"``
    PATHS           those path names

Why the directions serialize (issue 24): the DMA batch is host-bound with scattered pages.
``cuMemcpyBatchAsync`` holds the calling thread ~0.6 us (D2H) / ~1.5 us (H2D) per 4 KiB
descriptor (``Calibration.batch_<d>_us_per_descriptor``: 24,576 descriptors took 17.9 ms of host
time for 2 ms of copying), and one thread submits both directions, so the second batch is
issued only after the first one's driver call returned: the two directions' times add up.
Two copy kernels in opposite directions share the link through the SMs' loads and stores
(``Calibration.duplex_kernel_gbps``, about 45 GB/s together against 100 for two DMA copies); a
kernel against a DMA copy reaches ``duplex_mixed_gbps``. The staged path
(``kvmgr.transfer.staged``) leaves the link to the DMA engine with one descriptor per CPU run and
tensor, after (D2H) or before (H2D) a short device-to-device copy: with CPU ids in runs, two
staged directions approach the limit.

Model, in microseconds, for batches ``(n_d, B_d)`` per direction (``n`` the path's descriptors:
the plan's for ``dma``, CPU runs x tensors for ``staged``), ``alone`` a direction's step cost by
itself (``Calibration.<path>_step_us``), ``host`` its issue time (``kernel_launch_us`` for the
kernel, ``batch_launch_us + n * batch_<d>_us_per_descriptor`` for DMA, both for staged), the first
direction issued first::

    max(alone_1, host_1 + alone_2, (B_1 + B_2) / together)

``together`` = ``duplex_kernel_gbps`` for two kernels, ``duplex_mixed_gbps`` for a kernel and a
DMA-engine path (dma, staged), ``duplex_limit_gbps`` for two DMA-engine paths. Every pair and both
orders are modelled (18 evaluations at most). Pure: no device access.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from kvmgr.transfer.cost_model import Calibration, kernel_or_batch
from kvmgr.transfer.plan import Direction

__all__ = ["PATHS", "DuplexChoice", "choose_path", "duplex_choice"]

_D2H, _H2D = Direction.D2H, Direction.H2D
#: the copy paths a direction may take
PATHS = ("dma", "kernel", "staged")


@attrs.frozen
class DuplexChoice:
    """A step's copy paths.

    Attributes:
        d2h_kernel / h2d_kernel: whether that direction goes to the copy kernel.
        first: the direction to submit first.
        us: the modelled step cost of the pair (``0.0`` when a direction has no work).
        d2h_staged / h2d_staged: whether that direction is staged (never with ``*_kernel``).
    """

    d2h_kernel: bool
    h2d_kernel: bool
    first: Direction
    us: float = 0.0
    d2h_staged: bool = False
    h2d_staged: bool = False

    def kernel(self, direction: Direction) -> bool:
        """Whether ``direction`` goes to the copy kernel."""
        return self.d2h_kernel if direction is _D2H else self.h2d_kernel

    def path(self, direction: Direction) -> str:
        """``"kernel"``, ``"staged"`` or ``"dma"`` for ``direction``."""
        staged = self.d2h_staged if direction is _D2H else self.h2d_staged
        return "kernel" if self.kernel(direction) else "staged" if staged else "dma"


def _alone_us(calib: Calibration, direction: Direction, path: str, n: int, num_bytes: int, rows: int = 0) -> float:  # fmt: skip
    """``rows``: the plan's descriptors (the staged path's gather rows; ``n`` is its DMA's)."""
    if path == "kernel":
        return calib.kernel_step_us(n, num_bytes, direction)
    if path == "staged":
        return calib.staged_step_us(n, num_bytes, direction, rows)
    return calib.batch_step_us(n, num_bytes, direction)


def _host_us(calib: Calibration, direction: Direction, path: str, n: int) -> float:
    dma = calib.batch_launch_us + n * calib.batch_us_per_descriptor(direction)
    if path == "kernel":
        return calib.kernel_launch_us
    return dma + (calib.kernel_launch_us if path == "staged" else 0.0)


def _together_gbps(calib: Calibration, paths: tuple[str, str]) -> float:
    kernels = paths.count("kernel")
    if kernels == 2:
        return calib.duplex_kernel_gbps
    return calib.duplex_mixed_gbps if kernels == 1 else calib.duplex_limit_gbps


def _pair_us(
    calib: Calibration, counts: Mapping[Direction, tuple[int, int, int]],
    paths: Mapping[Direction, str], first: Direction,
) -> float:  # fmt: skip
    """``counts``: per direction (descriptors of its path, bytes, the plan's descriptors)."""
    second = _H2D if first is _D2H else _D2H
    (n1, b1, r1), (n2, b2, r2) = counts[first], counts[second]
    alone1 = _alone_us(calib, first, paths[first], n1, b1, r1)
    alone2 = _alone_us(calib, second, paths[second], n2, b2, r2)
    together = (b1 + b2) / (1e3 * _together_gbps(calib, (paths[first], paths[second])))
    # the second direction is issued once the first one's host part returned
    return max(alone1, _host_us(calib, first, paths[first], n1) + alone2, together)


def choose_path(
    num_descriptors: int, num_bytes: int, direction: Direction,
    calib: Calibration | None = None, staged_descriptors: int | None = None,
) -> str:  # fmt: skip
    """One direction alone: ``kernel_or_batch``'s choice (``"kernel"`` / ``"dma"``), or
    ``"staged"`` where ``staged_descriptors`` is given and its step cost beats both (the
    kernel's charged ``kernel_margin``, as the staged path's device part also takes SMs)."""
    calib = calib or Calibration()
    kernel = kernel_or_batch(num_descriptors, num_bytes, direction, calib) == "kernel"
    best = "kernel" if kernel else "dma"
    if staged_descriptors is None or not num_descriptors:
        return best
    if kernel:
        cost = calib.kernel_step_us(num_descriptors, num_bytes, direction) * calib.kernel_margin
    else:
        cost = calib.batch_step_us(num_descriptors, num_bytes, direction)
    staged = calib.staged_step_us(staged_descriptors, num_bytes, direction, num_descriptors)
    staged *= calib.kernel_margin
    return "staged" if staged < cost else best


def duplex_choice(
    d2h: tuple[int, int], h2d: tuple[int, int], calib: Calibration | None = None,
    *, staged: tuple[int | None, int | None] = (None, None),
) -> DuplexChoice:  # fmt: skip
    """The cheapest paths for a step that copies ``d2h = (descriptors, bytes)`` out and ``h2d``
    in at once, and the order to submit them in (module docstring). ``staged`` gives, per
    direction (D2H, H2D), the staged path's DMA descriptors (``staged_descriptors(plan)``), or
    ``None`` where that direction cannot be staged. With one direction empty, the other gets
    ``choose_path``'s choice and goes first. DMA-only pairs are taken on ties; a pair with a
    kernel or staged part must win by ``kernel_margin``.

    Raises:
        ValueError: a negative count.
    """
    calib = calib or Calibration()
    counts = {_D2H: d2h, _H2D: h2d}
    for n, num_bytes in counts.values():
        if n < 0 or num_bytes < 0:
            raise ValueError(f"expected counts >= 0, got {n} descriptors, {num_bytes} bytes")
    stage = {_D2H: staged[0], _H2D: staged[1]}
    if not d2h[0] or not h2d[0]:
        busy = _D2H if d2h[0] else _H2D
        path = choose_path(*counts[busy], busy, calib, stage[busy])
        return _choice({busy: path, _D2H if busy is _H2D else _H2D: "dma"}, busy, 0.0)
    return _best_pair(calib, counts, stage)


def _best_pair(
    calib: Calibration,
    counts: dict[Direction, tuple[int, int]],
    stage: dict[Direction, int | None],
) -> DuplexChoice:
    """``duplex_choice`` with both directions busy: every pair of paths in both orders, the
    cheapest after margins (DMA-only pairs win ties)."""
    options = {d: [p for p in PATHS if p != "staged" or stage[d] is not None] for d in Direction}
    best: DuplexChoice | None = None
    best_cost = 0.0
    for d2h_path in options[_D2H]:
        for h2d_path in options[_H2D]:
            paths = {_D2H: d2h_path, _H2D: h2d_path}
            used = {
                d: (stage[d] if paths[d] == "staged" else counts[d][0], counts[d][1], counts[d][0])
                for d in Direction
            }
            margin = 1.0 if d2h_path == h2d_path == "dma" else calib.kernel_margin
            for first in (_D2H, _H2D):
                us = _pair_us(calib, used, paths, first)  # type: ignore[arg-type]
                if best is None or us * margin < best_cost:
                    best, best_cost = _choice(paths, first, us), us * margin
    assert best is not None
    return best


def _choice(paths: Mapping[Direction, str], first: Direction, us: float) -> DuplexChoice:
    return DuplexChoice(
        paths[_D2H] == "kernel", paths[_H2D] == "kernel", first, us,
        paths[_D2H] == "staged", paths[_H2D] == "staged",
    )  # fmt: skip
