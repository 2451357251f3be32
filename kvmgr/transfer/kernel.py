"""The copy-kernel issuer: a whole plan in one copy-kernel launch.

Offers:
    KernelCopy      ``issue(plan, stream)``: the plan's runs or descriptors staged, uploaded and
                    launched on ``stream`` by a :class:`~kvmgr.kernels.copy.staging.CopyStager`

Two paths, one launch each (the staging, its tables and pools live beside the kernels, in
:mod:`kvmgr.kernels.copy.staging`):

- **paged** (:mod:`kvmgr.kernels.copy.blocks`), for a plan from ``build_plan`` (no descriptor array
  given or edited: ``TransferPlan.matching_blocks``) whose layouts the kernel can address (CPU, or
  the issuer's CUDA device): the plan's runs of blocks; the kernel computes every page address
  from a layout table kept on the device. Host work per plan is O(runs); the plan's descriptors
  are never built.
- **descriptors** (:mod:`kvmgr.kernels.copy.pages`), for any other plan (hand-made, edited, split):
  its descriptors, sliced above ``chunk_bytes`` so one merged run spreads over every program.

The kernels dereference host addresses, so every host page must be pinned or registered (the
engines send pageable tiers to DMA).
"""

from __future__ import annotations

from typing import Any

import torch

from kvmgr.errors import TransferError
from kvmgr.kernels.copy.row import DEFAULT_CHUNK_BYTES, DEFAULT_D2H_PROGRAMS, DEFAULT_H2D_PROGRAMS
from kvmgr.kernels.copy.staging import CopyStager, Staged
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.issued import Issued
from kvmgr.transfer.plan import Direction, TransferPlan

__all__ = ["KernelCopy"]

_MAX_PAIRS = 64  # layout pairs whose addressability is remembered


class KernelCopy:
    """Issues plans with one copy-kernel launch each.

    Args:
        device: the CUDA device the kernel runs on.
        driver: resolved entry points (the table upload is one ``cuMemcpyAsync``).
        d2h_programs, h2d_programs: program cap of a launch per direction (defaults 12 and 32:
            what a concurrent matmul loop loses is in docs/copy-kernel.md).
        chunk_bytes: descriptors above this are sliced, and runs above this many bytes of the
            largest page are split, so one merged run spreads over programs.

    Attributes:
        programs: the program cap per direction.
        stager: the staging and launches (its layout tables and packed launches).
        slots: the stager's pool of table slots.
    """

    path = "kernel"

    def __init__(
        self,
        device: torch.device,
        driver: CopyDriver,
        *,
        d2h_programs: int = DEFAULT_D2H_PROGRAMS,
        h2d_programs: int = DEFAULT_H2D_PROGRAMS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.driver = driver
        self.device = device
        self.programs = {Direction.D2H: d2h_programs, Direction.H2D: h2d_programs}
        self.chunk_bytes = chunk_bytes
        self.stager = CopyStager(device, driver.memcpy, chunk_bytes=chunk_bytes)
        self.slots = self.stager.slots
        self._addressable_pairs: dict[tuple[KVLayout, KVLayout], bool] = {}

    def issue(self, plan: TransferPlan, stream: Any) -> Issued:
        """Stage, upload and launch on ``stream`` (paged for a plan from ``build_plan`` whose
        layouts the kernel can address, else from the descriptors); a failed upload or launch is
        returned in ``error`` (the slot goes back to the pool after the end event all the same).

        A plan given any descriptor array (by hand, ``attrs.evolve``, ``split``) is copied from
        its descriptors even where its counts still match ``blocks``: they are what it says."""
        programs = self.programs[plan.direction]
        pairs = plan.matching_blocks()
        reach: bool | None = False
        if pairs is not None:
            reach = self._addressable_pairs.get((pairs.src, pairs.dst))  # the cached answer
            if reach is None:  # a new pair of layouts
                reach = self._addressable(pairs.src, pairs.dst)
        if pairs is not None and reach:
            runs = pairs.runs  # its fields directly: four property calls fewer a plan
            staged = self.stager.copy_runs(pairs.src, pairs.dst, runs.run_src, runs.run_dst,
                                           runs.lengths, programs, stream, max_run=runs.max_run)  # fmt: skip
        else:
            staged = self.stager.copy_descriptors(plan.src_addrs, plan.dst_addrs, plan.sizes,
                                                  programs, stream)  # fmt: skip
        if staged.error is None:
            return Issued("kernel", staged.num_launches, 0, staged.keep_alive, staged.release)
        return _issued(staged)

    def _addressable(self, src: KVLayout, dst: KVLayout) -> bool:
        """Whether both layouts are host memory (pinned or registered: the engine sends pageable
        tiers to DMA) or this issuer's device; cached per pair of layouts."""
        key = (src, dst)
        known = self._addressable_pairs.get(key)
        if known is None:
            known = self._on_reach(src) and self._on_reach(dst)
            if len(self._addressable_pairs) >= _MAX_PAIRS:
                self._addressable_pairs.pop(next(iter(self._addressable_pairs)), None)
            self._addressable_pairs[key] = known
        return known

    def _on_reach(self, layout: KVLayout) -> bool:
        device = layout.device
        if device.type == "cpu":
            return True
        return device.type == self.device.type and device.index in (None, self.device.index)


def _issued(staged: Staged) -> Issued:
    error = None
    if staged.error is not None:
        error = TransferError(f"copy kernel {staged.failed} failed: {staged.error}")
    return Issued("kernel", num_chunks=staged.num_launches, keep_alive=staged.keep_alive,
                  release=staged.release, error=error)  # fmt: skip
