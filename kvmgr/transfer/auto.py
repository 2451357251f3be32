"""The per-plan choice between the copy kernel and the DMA batch.

Offers:
    ChoiceCopy      ``issue(plan, stream)``: hands each plan to ``KernelCopy`` or ``DmaCopy``
    always_kernel   the choice of engine ``"kernel"``: every plan to the kernel
    cost_model      the choice of engine ``"auto"``: ``kernel_or_batch`` on the plan's counts
    cost_model_staged   engine ``"auto"``'s staging choice: ``choose_path`` with the plan's CPU runs

A plan goes to DMA whatever the choice says when the kernel cannot take it: no kernel (Triton
missing, or it failed its warm-up copy) or a CPU tier that fell back to pageable memory (the
kernel can only dereference pinned or registered host pages). The staged path
(``kvmgr.transfer.staged``: the kernel copies device to device only, the DMA engine crosses the
link) needs no mapped host pages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvmgr.transfer.cost_model import Calibration, kernel_or_batch
from kvmgr.transfer.dma import DmaCopy
from kvmgr.transfer.duplex import choose_path
from kvmgr.transfer.kernel import KernelCopy
from kvmgr.transfer.plan import Direction, TransferPlan
from kvmgr.transfer.staged import StagedCopy, staged_descriptors
from kvmgr.transfer.streams import Issued

__all__ = ["ChoiceCopy", "always_kernel", "cost_model", "cost_model_staged"]

#: ``(plan, num_bytes) -> True`` to copy with the kernel.
Choice = Callable[[TransferPlan, int], bool]


def always_kernel(plan: TransferPlan, num_bytes: int) -> bool:
    """Engine ``"kernel"``: every plan to the copy kernel."""
    del plan, num_bytes
    return True


def cost_model(calibration: Calibration) -> Choice:
    """Engine ``"auto"``: the kernel where ``kernel_or_batch`` (copy time plus the compute the
    copy slows, ``kvmgr.transfer.cost_model``) says so; a few float operations per plan."""

    def choose(plan: TransferPlan, num_bytes: int) -> bool:
        n = plan.num_descriptors
        return kernel_or_batch(n, num_bytes, plan.direction, calibration) == "kernel"

    return choose


def cost_model_staged(calibration: Calibration) -> Callable[[TransferPlan], bool]:
    """Engine ``"auto"``'s staging choice: whether ``choose_path`` picks ``"staged"`` for the
    plan, given its staged descriptors (CPU runs x tensors; O(blocks) numpy to count)."""

    def stage(plan: TransferPlan) -> bool:
        n = staged_descriptors(plan)
        if n is None:
            return False
        path = choose_path(plan.num_descriptors, plan.num_bytes, plan.direction, calibration, n)
        return path == "staged"

    return stage


class ChoiceCopy:
    """Sends each plan to the kernel or to DMA.

    Args:
        dma: the DMA issuer (also the fallback).
        kernel: the kernel issuer, or ``None`` when there is no usable kernel.
        choose: ``always_kernel`` or ``cost_model(calibration)``.
        staged: the staged issuer, or ``None`` (no staged path).
        stage: whether to stage a plan (``cost_model_staged``), asked before ``choose`` where
            ``staged`` is given.

    Attributes:
        pageable_host: set by the engine when a CPU-tier allocation fell back to pageable
            memory; from then on no plan goes to the kernel (the staged path still may).
        duplex: per direction, ``(path, descriptors, bytes)`` with path ``"kernel"``, ``"dma"``
            or ``"staged"``: the path the next plan of that direction takes whatever ``choose``
            says, if it has those counts (set by ``AutoEngine.plan_duplex`` for a step that
            copies both ways; used once).
    """

    def __init__(
        self, dma: DmaCopy, kernel: KernelCopy | None, choose: Choice,
        staged: StagedCopy | None = None, stage: Callable[[TransferPlan], bool] | None = None,
    ) -> None:  # fmt: skip
        self.dma = dma
        self.kernel = kernel
        self.choose = choose
        self.staged = staged
        self.stage = stage
        self.pageable_host = False
        self.duplex: dict[Direction, tuple[str, int, int]] = {}

    def issue(self, plan: TransferPlan, stream: Any) -> Issued:
        """Issue ``plan`` on ``stream`` with the chosen issuer."""
        kernel, staged = self.kernel, self.staged
        path = None
        if self.duplex:
            pending = self.duplex.pop(plan.direction, None)
            if pending is not None and pending[1:] == (plan.num_descriptors, plan.num_bytes):
                path = pending[0]
        if path is None and staged is not None and self.stage is not None and self.stage(plan):
            path = "staged"
        if path == "staged" and staged is not None and staged.can_stage(plan):
            return staged.issue(plan, stream)
        choose = self.choose  # always_kernel not called: two property reads and a call fewer
        if (
            kernel is not None
            and not self.pageable_host
            and plan.num_descriptors
            and (
                (choose is always_kernel or choose(plan, plan.num_bytes))
                if path is None
                else path == "kernel"
            )
        ):
            return kernel.issue(plan, stream)
        return self.dma.issue(plan, stream)
