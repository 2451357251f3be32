"""The per-batch cost model behind ``engine="auto"``: DMA batch or copy kernel.

Offers:
    Calibration     the model's constants (frozen; ``from_json`` / ``fit`` to recalibrate)
    kernel_or_batch ``"batch"`` or ``"kernel"`` for a batch's descriptor and byte counts

A batch of ``n`` descriptors and ``B`` bytes in direction ``d`` is modelled, in microseconds, as::

    batch(n, B)  = batch_launch_us  + n * batch_<d>_us_per_descriptor + B / (1e3 * batch_<d>_gbps)
    kernel(n, B) = kernel_launch_us + n * kernel_us_per_descriptor    + B / (1e3 * kernel_<d>_gbps)

Those are copy times. A serving loop overlaps the copy with its own kernels, and the copy kernel
takes SMs from them: with 32 programs a D2H copy slowed a concurrent bf16 matmul by 58% on the H200
(BENCHMARKS.md), the DMA engines by ~0%. What the loop pays is its step time, so each path is
charged the compute it slows while it runs::

    cost(path) = copy_us(path) * (1 + compute_overlap * <path>_<d>_slowdown)

``compute_overlap`` is the fraction of the copy during which compute runs (1: a loop that always
overlaps, the default; 0: copies alone, the old copy-time-only choice). The kernel is chosen when
``cost(kernel) * kernel_margin < cost(batch)``. The DMA batch's per-descriptor
cost depends on the direction: on the H200 with registered host memory, ``cuMemcpyBatchAsync``
spends ~0.6 us per 4 KiB descriptor out of the GPU and ~1.5 us into it.

The defaults were fitted to the H200 runs of ``kvmgr bench swap`` and ``kvmgr bench swap-kernel``
(2026-11-29; docs/copy-kernel.md says how, and how to recalibrate). Everything here is pure: no
device access.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvmgr.errors import ConfigError
from kvmgr.transfer import calibration_fit
from kvmgr.transfer.plan import Direction

__all__ = ["Calibration", "kernel_or_batch"]

_positive = attrs.validators.gt(0.0)
_non_negative = attrs.validators.ge(0.0)


@attrs.frozen(kw_only=True)
class Calibration:
    """Constants of the per-batch cost model (module docstring); defaults: H200, 2026-11-29.

    Attributes:
        batch_launch_us: fixed cost of a driver batch (the call, its events). 10 us: an estimate;
            the benchmarks' scattered batches (>= 3,072 descriptors) cannot resolve it.
        batch_h2d_us_per_descriptor / batch_d2h_us_per_descriptor: DMA cost per descriptor
            beyond the bytes, 1.47 / 0.60 us (4 KiB pages; the driver call holds the caller's
            thread for most of it; larger pages cost ~0.3-1.0 us per descriptor either way).
        batch_h2d_gbps / batch_d2h_gbps: DMA bandwidth of one 1 GiB copy with registered host
            memory, 55.4 / 55.1 GB/s.
        kernel_launch_us: table building, staging, upload and launch, as the device sees them
            (the events bracket the host's issue). 110 us.
        kernel_us_per_descriptor: per-descriptor cost not hidden behind the copy. 0.003 us.
        kernel_h2d_gbps / kernel_d2h_gbps: copy-kernel bandwidth over mapped host memory with the
            default program caps (H2D 32, D2H 8): 49.4 / 48.9 GB/s.
        kernel_h2d_slowdown / kernel_d2h_slowdown: fraction by which a concurrent bf16 matmul
            loop runs slower while the kernel copies, at the default caps: 0.056 / 0.052
            (32 programs D2H: 0.58; ``kvmgr bench swap-kernel`` interference table).
        batch_slowdown: the same for the DMA batch, 0.003.
        compute_overlap: fraction of a copy during which the loop computes, in [0, 1]; 1.
        kernel_margin: factor by which the kernel must win; DMA leaves the SMs to compute, so it
            keeps close calls. 1.1 (not fitted).
        duplex_kernel_gbps: both directions' bytes per second together when the copy kernel
            copies both at once: 64 GB/s (``kvmgr bench duplex`` on the H200, 2026-12-02, the
            paged kernel, fitted by ``scripts/fit_calibration.py``: 59-62 GB/s with 4 KiB pages,
            65-71 with 32 KiB; the SMs' host reads and writes share the link).
            ``duplex.duplex_choice``.
        duplex_limit_gbps: both directions together at best (two contiguous copies in opposite
            directions at once): 98 GB/s (the same run: 93-101 GB/s).
        duplex_mixed_gbps: both directions together when the copy kernel copies one way and the
            DMA engine the other: 69 GB/s (the same run, a kernel against a contiguous copy:
            0.66-0.92 of the limit).
        staged_gather_gbps, staged_gather_us_per_row: the staged path's device-to-device part
            (the copy kernel's gather or scatter between the GPU tier and the staging buffer)
            costs ``rows * staged_gather_us_per_row + bytes / staged_gather_gbps``, ``rows`` the
            plan's descriptors (a run of one tensor each): 479 GB/s and 0.0185 us, fitted to the
            H200's ``kvmgr bench duplex`` gather rows of 2026-12-02 (512 blocks: 48 x 4 KiB
            pages 665-684 us, 148 GB/s; 64 x 32 KiB 2,818-2,892 us, 371-381 GB/s; one rate alone
            cannot fit both page sizes).
        staged_slowdown: the compute slowdown while that part runs: 0.5 (an estimate: it
            streams HBM with the staged kernel's programs, but only for ~1/10 of the copy).

    Raises:
        ConfigError: a direction's charged ``batch_*_us_per_descriptor`` is below ``kernel_margin *
            kernel_us_per_descriptor`` charged (the choice would stop being monotone in the count).
        ValueError: a value is out of range.
    """

    batch_launch_us: float = attrs.field(default=10.0, validator=_non_negative)
    batch_h2d_us_per_descriptor: float = attrs.field(default=1.47, validator=_non_negative)
    batch_d2h_us_per_descriptor: float = attrs.field(default=0.60, validator=_non_negative)
    batch_h2d_gbps: float = attrs.field(default=55.4, validator=_positive)
    batch_d2h_gbps: float = attrs.field(default=55.1, validator=_positive)
    kernel_launch_us: float = attrs.field(default=110.0, validator=_non_negative)
    kernel_us_per_descriptor: float = attrs.field(default=0.003, validator=_non_negative)
    kernel_h2d_gbps: float = attrs.field(default=49.4, validator=_positive)
    kernel_d2h_gbps: float = attrs.field(default=48.9, validator=_positive)
    kernel_h2d_slowdown: float = attrs.field(default=0.056, validator=_non_negative)
    kernel_d2h_slowdown: float = attrs.field(default=0.052, validator=_non_negative)
    batch_slowdown: float = attrs.field(default=0.003, validator=_non_negative)
    compute_overlap: float = attrs.field(
        default=1.0, validator=[_non_negative, attrs.validators.le(1.0)]
    )
    kernel_margin: float = attrs.field(default=1.1, validator=attrs.validators.ge(1.0))
    duplex_kernel_gbps: float = attrs.field(default=64.0, validator=_positive)
    duplex_limit_gbps: float = attrs.field(default=98.0, validator=_positive)
    duplex_mixed_gbps: float = attrs.field(default=69.0, validator=_positive)
    staged_gather_gbps: float = attrs.field(default=479.0, validator=_positive)
    staged_gather_us_per_row: float = attrs.field(default=0.0185, validator=_non_negative)
    staged_slowdown: float = attrs.field(default=0.5, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        for direction in Direction:
            kernel_charge, batch_charge = self._charges(direction)
            floor = self.kernel_margin * self.kernel_us_per_descriptor * kernel_charge
            per_descriptor = self.batch_us_per_descriptor(direction)
            if per_descriptor * batch_charge < floor:
                raise ConfigError(
                    f"expected batch_{direction.value}_us_per_descriptor >= kernel_margin * "
                    f"kernel_us_per_descriptor, got {per_descriptor} < {self.kernel_margin} * "
                    f"{self.kernel_us_per_descriptor}"
                )

    def batch_us_per_descriptor(self, direction: Direction) -> float:
        """The DMA batch's per-descriptor microseconds in ``direction``."""
        return _pick(direction, self.batch_h2d_us_per_descriptor, self.batch_d2h_us_per_descriptor)

    def batch_us(self, num_descriptors: int, num_bytes: int, direction: Direction) -> float:
        """Modelled microseconds of one ``cuMemcpyBatchAsync`` batch."""
        gbps = _pick(direction, self.batch_h2d_gbps, self.batch_d2h_gbps)
        per_descriptor = num_descriptors * self.batch_us_per_descriptor(direction)
        return self.batch_launch_us + per_descriptor + num_bytes / (1e3 * gbps)

    def kernel_us(self, num_descriptors: int, num_bytes: int, direction: Direction) -> float:
        """Modelled microseconds of one copy-kernel batch."""
        gbps = _pick(direction, self.kernel_h2d_gbps, self.kernel_d2h_gbps)
        per_descriptor = num_descriptors * self.kernel_us_per_descriptor
        return self.kernel_launch_us + per_descriptor + num_bytes / (1e3 * gbps)

    def batch_step_us(self, num_descriptors: int, num_bytes: int, direction: Direction) -> float:
        """``batch_us`` plus the compute it slows (module docstring)."""
        charge = 1.0 + self.compute_overlap * self.batch_slowdown
        return self.batch_us(num_descriptors, num_bytes, direction) * charge

    def kernel_step_us(self, num_descriptors: int, num_bytes: int, direction: Direction) -> float:
        """``kernel_us`` plus the compute it slows (module docstring)."""
        slowdown = _pick(direction, self.kernel_h2d_slowdown, self.kernel_d2h_slowdown)
        charge = 1.0 + self.compute_overlap * slowdown
        return self.kernel_us(num_descriptors, num_bytes, direction) * charge

    def staged_gather_us(self, num_bytes: int, num_rows: int = 0) -> float:
        """Modelled microseconds of the staged path's device-to-device part (one launch) over
        ``num_rows`` runs (the plan's descriptors) of ``num_bytes`` in all."""
        rows_us = num_rows * self.staged_gather_us_per_row
        return self.kernel_launch_us + rows_us + num_bytes / (1e3 * self.staged_gather_gbps)

    def staged_step_us(
        self, num_descriptors: int, num_bytes: int, direction: Direction, gather_rows: int = 0
    ) -> float:
        """The staged path (``kvmgr.transfer.staged``): its device-to-device part over
        ``gather_rows`` runs, then (D2H; before it, H2D) the DMA batch of ``num_descriptors``
        (CPU runs x tensors) on the same stream, each charged the compute it slows (module
        docstring)."""
        charge = 1.0 + self.compute_overlap * self.staged_slowdown
        gather = self.staged_gather_us(num_bytes, gather_rows) * charge
        return gather + self.batch_step_us(num_descriptors, num_bytes, direction)

    def crossover_bytes(self, direction: Direction) -> float | None:
        """Bytes per descriptor above which DMA wins large batches (launch costs ignored, step
        costs compared); ``None`` if the kernel wins at every size."""
        batch_gbps = _pick(direction, self.batch_h2d_gbps, self.batch_d2h_gbps)
        kernel_gbps = _pick(direction, self.kernel_h2d_gbps, self.kernel_d2h_gbps)
        kernel_charge, batch_charge = self._charges(direction)
        kernel_charge *= self.kernel_margin
        us_per_byte = kernel_charge / (1e3 * kernel_gbps) - batch_charge / (1e3 * batch_gbps)
        saved_us = (
            batch_charge * self.batch_us_per_descriptor(direction)
            - kernel_charge * self.kernel_us_per_descriptor
        )
        return saved_us / us_per_byte if us_per_byte > 0 else None

    def _charges(self, direction: Direction) -> tuple[float, float]:
        """``(kernel, batch)`` factors ``1 + compute_overlap * slowdown``."""
        slowdown = _pick(direction, self.kernel_h2d_slowdown, self.kernel_d2h_slowdown)
        overlap = self.compute_overlap
        return 1.0 + overlap * slowdown, 1.0 + overlap * self.batch_slowdown

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        """Build from field names to numbers; missing fields keep their defaults. The older
        ``batch_us_per_descriptor`` sets both directions' values.

        Raises:
            ConfigError: an unknown field, a non-numeric value or an invalid combination.
        """
        return calibration_fit.from_dict(cls, data)

    @classmethod
    def from_json(cls, source: str | os.PathLike[str] | Mapping[str, Any]) -> Calibration:
        """Read a calibration from a JSON file, JSON text or parsed mapping: the fields under
        ``"calibration"`` (``kvmgr bench swap-kernel --json``), else a fit of the ``"copies"`` rows
        with the ``"peak"`` rows as DMA bandwidth (``kvmgr bench swap --json``, see ``fit``), else
        the fields at the top level.

        Raises:
            ConfigError: unreadable JSON or invalid values.
        """
        return calibration_fit.from_json(cls, source)

    @classmethod
    def fit_duplex(
        cls, rows: Sequence[Mapping[str, Any]], base: Calibration | None = None
    ) -> Calibration:
        """Set ``duplex_kernel_gbps``, ``duplex_limit_gbps`` and ``duplex_mixed_gbps`` to the
        medians of ``kvmgr bench duplex``'s ``"kernel+kernel"``, ``"limit"`` and
        ``"kernel+contiguous"`` / ``"contiguous+kernel"`` rows (``variant``, ``gbps``: both
        directions' bytes over the time both took); other fields from ``base``. The staged
        gather's two constants are fitted over two page sizes (see the class docstring), not
        from one rate.

        Raises:
            ConfigError: a row lacks a key, or the values are invalid.
        """
        return calibration_fit.fit_duplex(cls, rows, base)

    @classmethod
    def fit(
        cls,
        rows: Sequence[Mapping[str, Any]],
        base: Calibration | None = None,
        *,
        peak_rows: Sequence[Mapping[str, Any]] = (),
        interference_rows: Sequence[Mapping[str, Any]] = (),
    ) -> Calibration:
        """Fit the constants to measured batches (how: ``kvmgr.transfer.calibration_fit.fit``).

        Args:
            rows: benchmark rows (``kvmgr bench swap`` / ``swap-kernel`` ``"copies"``) with
                ``variant``, ``direction`` (``h2d``/``d2h``), ``descriptors``, ``bytes``, ``us``;
                other variants are ignored.
            base: values kept where the rows determine nothing (default model if ``None``).
            peak_rows: ``kvmgr bench swap``'s ``"peak"`` rows (``memory``, ``direction``, ``gbps``).
            interference_rows: ``kvmgr bench swap-kernel``'s ``"interference"`` rows (``variant``,
                ``direction``, ``slowdown_pct``): the ``kernel`` rows set
                ``kernel_<d>_slowdown``, the ``batch`` rows' mean sets ``batch_slowdown``
                (negative medians, noise, count as 0).

        Raises:
            ConfigError: a row lacks a key, or the fitted values are invalid together.
        """
        return calibration_fit.fit(cls, rows, base, peak_rows, interference_rows)


def _pick(direction: Direction, h2d: float, d2h: float) -> float:
    return h2d if direction is Direction.H2D else d2h


def kernel_or_batch(
    num_descriptors: int,
    num_bytes: int,
    direction: Direction | str,
    calib: Calibration | None = None,
) -> str:
    """``"kernel"`` if the copy kernel's modelled step cost (copy plus the compute it slows, module
    docstring) beats the DMA batch's by ``kernel_margin``, else ``"batch"`` (also for an empty
    batch). A few float operations; pure: no device access.

    Raises:
        ValueError: a negative count or an unknown direction.
    """
    if num_descriptors < 0 or num_bytes < 0:
        raise ValueError(
            f"expected counts >= 0, got {num_descriptors} descriptors, {num_bytes} bytes"
        )
    direction = Direction(direction)
    if num_descriptors == 0:
        return "batch"
    calib = calib or Calibration()
    kernel = calib.kernel_step_us(num_descriptors, num_bytes, direction) * calib.kernel_margin
    batch = calib.batch_step_us(num_descriptors, num_bytes, direction)
    return "kernel" if kernel < batch else "batch"
