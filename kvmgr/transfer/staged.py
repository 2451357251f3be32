"""The staged issuer: scattered GPU pages through a contiguous GPU staging buffer, so the DMA
engine sees one descriptor per run of consecutive CPU blocks and tensor (issue 24).

Offers:
    StagedCopy          ``issue(plan, stream)``: D2H = a device-to-device gather (the copy kernel)
                        into the staging buffer, then the DMA batch staging -> pinned host; H2D =
                        the DMA batch host -> staging, then a device-to-device scatter
    host_runs           runs of consecutive CPU block ids in a plan (what the staged DMA costs)
    staged_descriptors  the staged DMA's descriptor count for a plan, or ``None`` (not stageable)
    DEFAULT_STAGING_BYTES   staging bytes per direction and page geometry

Why: a DMA batch of scattered 4 KiB pages is host-bound (~0.6-1.5 us of driver time per
descriptor, ``Calibration.batch_<d>_us_per_descriptor``), and one thread's long driver call
delays the other direction's issue; a copy kernel in both directions shares the SMs' link
bandwidth (``Calibration.duplex_kernel_gbps``). Staged, the only PCIe traffic is the DMA engine's
over few large descriptors (the CPU tier is dense per tensor: a run of ``k`` consecutive CPU
blocks is one ``k * page`` region per tensor), and the SMs copy only device to device (HBM,
~10x the link). What it needs: CPU ids in runs (the CPU tier hands out fresh ids in order and
blocks evicted together as sorted runs, ``kvmgr.pool.allocator``); the GPU side may be scattered
(the staging slots follow the CPU order). With scattered CPU ids it issues as many descriptors
as the plain DMA batch plus the gather: ``auto`` then does not pick it.

Staging memory (rule 7, "memory a stream may still touch is never handed out again"): one
buffer per (direction, page geometry), ``staging_bytes`` each, allocated on first use and never
freed before the issuer is dropped. A plan larger than the buffer goes in chunks that reuse it in
stream order (gather then DMA of chunk ``k`` before the gather of chunk ``k + 1`` on the same
stream). Across plans, every use first makes its stream wait for the event recorded after the
buffer's previous use (a device wait, no host sync), so a plan issued on another stream never
overwrites pages a DMA still reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch

from kvmgr.errors import TransferError
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer.block_pairs import BlockPairs
from kvmgr.transfer.plan import Direction, TransferPlan, build_plan
from kvmgr.transfer.streams import CopyIssuer, Issued

__all__ = ["DEFAULT_STAGING_BYTES", "StagedCopy", "host_runs", "staged_descriptors"]

#: Staging bytes per (direction, page geometry), engine "auto"'s default: 320 blocks of
#: Qwen2.5-0.5B (48 x 4 KiB) a chunk, 31 of Llama-3-8B (64 x 32 KiB); the chunks of a plan run
#: back to back on its stream, each adding one launch and one driver call of host time.
DEFAULT_STAGING_BYTES = 64 << 20
_ALIGN = 256  # each tensor's staging pages start on this many bytes


def host_runs(plan: TransferPlan) -> int | None:
    """Runs of consecutive CPU block ids among the plan's pairs (the CPU side is the destination
    of a D2H plan, the source of an H2D one), or ``None`` for a plan not from ``build_plan``.
    O(blocks) numpy."""
    pairs = plan.matching_blocks()
    if pairs is None:
        return None
    ids = pairs.dst_block_ids if plan.direction is Direction.D2H else pairs.src_block_ids
    if len(ids) == 0:
        return 0
    if len(ids) > 1 and bool((ids[1:] < ids[:-1]).any()):
        ids = np.sort(ids)  # merged H2D pairs are sorted by source (the CPU side) already
    return 1 + int(np.count_nonzero(ids[1:] - ids[:-1] != 1))


def staged_descriptors(plan: TransferPlan) -> int | None:
    """Descriptors of the staged path's DMA part (CPU runs x tensors: the staging buffer and the
    CPU tier are dense per tensor), or ``None`` for a plan it cannot stage (hand-made or edited,
    or a CPU side that is not dense)."""
    runs = host_runs(plan)
    if runs is None:
        return None
    pairs = plan.matching_blocks()
    assert pairs is not None
    host = pairs.dst if plan.direction is Direction.D2H else pairs.src
    if not bool(host.is_dense.all()):
        return None
    return runs * host.num_tensors


@attrs.define(eq=False)
class _Staging:
    """One staging buffer: ``tensor`` (uint8, on the device) viewed as a dense ``layout`` of
    ``num_blocks`` blocks; ``last_use`` the event recorded after its last use, or ``None``."""

    tensor: torch.Tensor
    layout: KVLayout
    num_blocks: int
    last_use: Any = None


class StagedCopy:
    """Issues plans through a device staging buffer (module docstring).

    Args:
        device: where the staging buffers live (the GPU tier's device).
        move: the device-to-device issuer (``KernelCopy``; a test may pass any ``CopyIssuer``
            that copies between the layouts it is given).
        dma: the DMA issuer (``DmaCopy``): the staged DMA part, and every plan it cannot stage.
        staging_bytes: bytes of one staging buffer (one per direction and page geometry).
        event: makes the per-use fence event (``torch.cuda.Event`` if ``None``).

    Raises:
        ValueError: ``staging_bytes < 1``.
    """

    path = "staged"

    def __init__(
        self,
        device: torch.device,
        move: CopyIssuer,
        dma: CopyIssuer,
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        event: Callable[[], Any] | None = None,
    ) -> None:
        if staging_bytes < 1:
            raise ValueError(f"expected staging_bytes >= 1, got {staging_bytes}")
        self.device = device
        self.move = move
        self.dma = dma
        self.staging_bytes = staging_bytes
        self._event = event
        self._buffers: dict[tuple[Direction, tuple[int, ...]], _Staging] = {}

    @property
    def num_buffers(self) -> int:
        """Staging buffers allocated so far."""
        return len(self._buffers)

    def can_stage(self, plan: TransferPlan) -> bool:
        """Whether ``issue`` stages ``plan`` (else it goes to ``dma`` as it is): a plan from
        ``build_plan`` with a dense CPU side and at least one block, whose block fits the
        staging buffer."""
        if staged_descriptors(plan) in (None, 0):
            return False
        pairs = plan.matching_blocks()
        assert pairs is not None
        return _padded_block_bytes(pairs.src.page_bytes) <= self.staging_bytes

    def issue(self, plan: TransferPlan, stream: Any) -> Issued:
        """Enqueue ``plan`` on ``stream`` staged (chunks of the buffer's blocks: gather + DMA for
        D2H, DMA + scatter for H2D), or by ``dma`` where ``can_stage`` is false. A refused call
        stops the chunks after it and is returned in ``error`` (``fail_index`` ``None``: staged
        descriptors are not the plan's); the chunks before it still run."""
        if not self.can_stage(plan):
            return self.dma.issue(plan, stream)
        pairs = plan.matching_blocks()
        assert pairs is not None
        d2h = plan.direction is Direction.D2H
        gpu, host = (pairs.src, pairs.dst) if d2h else (pairs.dst, pairs.src)
        gpu_ids, host_ids = _by_host_block(pairs, d2h)
        buffer = self._buffer(plan.direction, gpu)
        if buffer.last_use is not None:
            stream.wait_event(buffer.last_use)  # its previous use may be on another stream
        issued: list[Issued] = []
        error: TransferError | None = None
        for first in range(0, len(gpu_ids), buffer.num_blocks):
            g = gpu_ids[first : first + buffer.num_blocks]
            h = host_ids[first : first + buffer.num_blocks]
            slots = np.arange(len(g), dtype=np.int64)
            if d2h:
                steps = ((self.move, build_plan(Direction.D2H, gpu, buffer.layout, g, slots)),
                         (self.dma, build_plan(Direction.D2H, buffer.layout, host, slots, h)))  # fmt: skip
            else:
                steps = ((self.dma, build_plan(Direction.H2D, host, buffer.layout, h, slots)),
                         (self.move, build_plan(Direction.H2D, buffer.layout, gpu, slots, g)))  # fmt: skip
            for issuer, part in steps:
                one = issuer.issue(part, stream)
                issued.append(attrs.evolve(one, keep_alive=(*one.keep_alive, part)))
                if one.error is not None:
                    error = TransferError(f"staged {one.path} part: {one.error}")
                    break
            if error is not None:
                break
        event = self._event() if self._event is not None else torch.cuda.Event()
        event.record(stream)
        buffer.last_use = event
        return _joined(issued, buffer, error)

    def _buffer(self, direction: Direction, gpu: KVLayout) -> _Staging:
        """The staging buffer of ``direction`` for ``gpu``'s page bytes (allocated once)."""
        pages = tuple(int(p) for p in gpu.page_bytes)
        key = (direction, pages)
        buffer = self._buffers.get(key)
        if buffer is None:
            num_blocks = self.staging_bytes // _padded_block_bytes(gpu.page_bytes)
            tensor = torch.empty(self.staging_bytes, dtype=torch.uint8, device=self.device)
            views, offset = [], 0
            for page in pages:
                views.append(tensor[offset : offset + num_blocks * page].view(num_blocks, page))
                offset = -(-(offset + num_blocks * page) // _ALIGN) * _ALIGN
            buffer = _Staging(tensor, KVLayout.from_tensors(views), num_blocks)
            self._buffers[key] = buffer
        return buffer


def _by_host_block(pairs: BlockPairs, d2h: bool) -> tuple[np.ndarray, np.ndarray]:
    """The pairs' GPU and CPU block ids (int64 ``[n]`` each), sorted by CPU block where they
    are not (stably): staging slots follow the CPU order, so CPU runs are staging runs."""
    gpu_ids, host_ids = (
        (pairs.src_block_ids, pairs.dst_block_ids)
        if d2h
        else (pairs.dst_block_ids, pairs.src_block_ids)
    )
    if len(host_ids) > 1 and bool((host_ids[1:] < host_ids[:-1]).any()):
        order = np.argsort(host_ids, kind="stable")
        gpu_ids, host_ids = gpu_ids[order], host_ids[order]
    return gpu_ids, host_ids


def _padded_block_bytes(page_bytes: np.ndarray) -> int:
    """Staging bytes one block needs at most, alignment padding included."""
    return int(page_bytes.sum()) + _ALIGN * len(page_bytes)


def _joined(parts: list[Issued], buffer: _Staging, error: TransferError | None) -> Issued:
    """One ``Issued`` for the staged parts: their keep-alives (and the buffer), one release that
    calls theirs."""
    releases = [p.release for p in parts if p.release is not None]

    def release() -> None:
        for r in releases:
            r()

    keep: tuple[Any, ...] = (buffer.tensor, *(k for p in parts for k in p.keep_alive))
    return Issued(
        "staged",
        num_chunks=sum(p.num_chunks for p in parts),
        num_fallbacks=sum(p.num_fallbacks for p in parts),
        keep_alive=keep,
        release=release if releases else None,
        error=error,
    )
