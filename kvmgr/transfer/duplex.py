"""Both directions at once: which path copies each direction, and which is issued first.

Offers:
    DuplexChoice    a step's paths per direction, the submission order, the modelled microseconds
    duplex_choice   the cheapest of the four (D2H path, H2D path) pairs for a step's two batches

Why the directions serialize (issue 24): the DMA batch is host-bound with scattered pages.
``cuMemcpyBatchAsync`` holds the calling thread ~0.6 us (D2H) / ~1.5 us (H2D) per 4 KiB
descriptor (``Calibration.batch_<d>_us_per_descriptor``: 24,576 descriptors took 17.9 ms of host
time for 2 ms of copying), and one thread submits both directions, so the second batch is
issued only after the first one's driver call returned: the two directions' times add up.
Two copy kernels in opposite directions share the link through the SMs' loads and stores
(``Calibration.duplex_kernel_gbps``, about 45 GB/s together against 100 for two DMA copies).
The cheap pairing is therefore mixed: the kernel issued first (its host cost is ~100-200 us
whatever the page count), then the DMA batch of the other direction, whose long driver call
then runs while the kernel copies.

Model, in microseconds, for batches ``(n_d, B_d)`` per direction, with ``Calibration``'s
constants (``batch_us`` / ``kernel_us`` of one direction alone; host part of a DMA batch =
``batch_launch_us + n * batch_<d>_us_per_descriptor``, of a kernel ``kernel_launch_us``)::

    dma + dma          max(host_1 + host_2 + B_2 / gbps_2, batch_us_1, (B_1 + B_2) / limit)
    kernel + kernel    max(kernel_us_1, kernel_us_2, (B_1 + B_2) / duplex_kernel_gbps)
    kernel, then dma   max(kernel_us_k, kernel_launch_us + batch_us_b, (B_1 + B_2) / limit)

each copy time charged the compute it slows (``1 + compute_overlap * slowdown`` of its path,
``cost_model``). Pure: no device access.
"""

from __future__ import annotations

import attrs

from kvmgr.transfer.cost_model import Calibration, kernel_or_batch
from kvmgr.transfer.plan import Direction

__all__ = ["DuplexChoice", "duplex_choice"]

_D2H, _H2D = Direction.D2H, Direction.H2D


@attrs.frozen
class DuplexChoice:
    """A step's copy paths.

    Attributes:
        d2h_kernel / h2d_kernel: whether that direction goes to the copy kernel.
        first: the direction to submit first.
        us: the modelled step cost of the pair (``0.0`` when a direction has no work).
    """

    d2h_kernel: bool
    h2d_kernel: bool
    first: Direction
    us: float = 0.0

    def kernel(self, direction: Direction) -> bool:
        """Whether ``direction`` goes to the copy kernel."""
        return self.d2h_kernel if direction is _D2H else self.h2d_kernel


def _charge(calib: Calibration, direction: Direction, kernel: bool) -> float:
    if kernel:
        slowdown = calib.kernel_h2d_slowdown if direction is _H2D else calib.kernel_d2h_slowdown
    else:
        slowdown = calib.batch_slowdown
    return 1.0 + calib.compute_overlap * slowdown


def _host_us(calib: Calibration, direction: Direction, n: int, kernel: bool) -> float:
    if kernel:
        return calib.kernel_launch_us
    return calib.batch_launch_us + n * calib.batch_us_per_descriptor(direction)


def _alone_us(calib: Calibration, direction: Direction, n: int, num_bytes: int, kernel: bool) -> float:  # fmt: skip
    copy = calib.kernel_us if kernel else calib.batch_us
    return copy(n, num_bytes, direction) * _charge(calib, direction, kernel)


def _pair_us(
    calib: Calibration, counts: dict[Direction, tuple[int, int]], kernel: dict[Direction, bool],
    first: Direction,
) -> float:  # fmt: skip
    second = _H2D if first is _D2H else _D2H
    (n1, b1), (n2, b2) = counts[first], counts[second]
    k1, k2 = kernel[first], kernel[second]
    alone1 = _alone_us(calib, first, n1, b1, k1)
    alone2 = _alone_us(calib, second, n2, b2, k2)
    total_bytes = b1 + b2
    if k1 and k2:
        return max(alone1, alone2, total_bytes / (1e3 * calib.duplex_kernel_gbps))
    # the second batch is issued once the first one's host part returned
    start2 = _host_us(calib, first, n1, k1)
    return max(alone1, start2 + alone2, total_bytes / (1e3 * calib.duplex_limit_gbps))


def duplex_choice(
    d2h: tuple[int, int], h2d: tuple[int, int], calib: Calibration | None = None
) -> DuplexChoice:
    """The cheapest paths for a step that copies ``d2h = (descriptors, bytes)`` out and ``h2d``
    in at once, and the order to submit them in (module docstring). With one direction empty,
    the other gets ``kernel_or_batch``'s choice and goes first.

    Raises:
        ValueError: a negative count.
    """
    calib = calib or Calibration()
    counts = {_D2H: d2h, _H2D: h2d}
    for n, num_bytes in counts.values():
        if n < 0 or num_bytes < 0:
            raise ValueError(f"expected counts >= 0, got {n} descriptors, {num_bytes} bytes")
    if not d2h[0] or not h2d[0]:
        busy = _D2H if d2h[0] else _H2D
        alone = kernel_or_batch(*counts[busy], busy, calib) == "kernel"
        return DuplexChoice(alone and busy is _D2H, alone and busy is _H2D, busy)
    best: DuplexChoice | None = None
    for d2h_kernel in (False, True):
        for h2d_kernel in (False, True):
            kernel = {_D2H: d2h_kernel, _H2D: h2d_kernel}
            # the kernel first (cheap to issue), DMA's long driver call second
            first = _H2D if h2d_kernel and not d2h_kernel else _D2H
            us = _pair_us(calib, counts, kernel, first)
            margin = 1.0 if not (d2h_kernel or h2d_kernel) else calib.kernel_margin
            if best is None or us * margin < best.us:
                best = DuplexChoice(d2h_kernel, h2d_kernel, first, us)
    assert best is not None
    return best
