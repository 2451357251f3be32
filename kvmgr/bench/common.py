"""Shared pieces of the transfer benchmarks (``kvmgr bench swap``, ``swap-kernel``, ``peer``).

Offers:
    GEOMETRIES              benchmark KV geometries (tensors x page bytes)
    CopyCase, Variant       what a copy variant receives and returns
    CasePool                a geometry's GPU tensors and registered host region, drawing cases
    default_variants        ``loop``, ``batch_c``, ``batch_lists``: the driver's call paths
    select_variants         the ``--variants`` subset, old names accepted (``DEPRECATED_VARIANTS``)
    kernel_variant          the engines' kernel issue (``KernelCopy``) at a program cap: paged
                            (a plan from ``build_plan``) or from a descriptor table
    auto_variant            the engines' per-plan choice (``ChoiceCopy`` over the cost model)
    all_variants            the defaults plus ``kernel``, ``kernel_desc`` and ``auto``
    time_issue, verify      timing with events, checking against the source

Benchmarks import the library; nothing in the library imports this package.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time
import warnings
from collections.abc import Callable

import attrs
import numpy as np
import torch

from kvmgr.kernels.copy.row import DEFAULT_D2H_PROGRAMS, DEFAULT_H2D_PROGRAMS, KERNEL_AVAILABLE
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer.auto import ChoiceCopy, cost_model
from kvmgr.transfer.cost_model import Calibration
from kvmgr.transfer.dma import DmaCopy
from kvmgr.transfer.driver import CopyDriver, access_order
from kvmgr.transfer.kernel import KernelCopy
from kvmgr.transfer.pinned import PinnedHostBuffer
from kvmgr.transfer.plan import Direction, TransferPlan, build_plan

__all__ = [
    "DEPRECATED_VARIANTS",
    "GEOMETRIES",
    "CasePool",
    "CopyCase",
    "Variant",
    "all_variants",
    "auto_variant",
    "default_variants",
    "kernel_variant",
    "select_variants",
    "time_issue",
    "verify",
]

#: name -> (label, num_tensors, page_bytes)
GEOMETRIES: dict[str, tuple[str, int, int]] = {
    "qwen": ("Qwen2.5-0.5B", 48, 4096),
    "llama": ("Llama-3-8B", 64, 32768),
    "mla": ("DeepSeek MLA", 61, 64 * 656),
}


@attrs.frozen(eq=False)
class CopyCase:
    """One benchmark case: copy ``plan`` (``src_ids[i] -> dst_ids[i]``) on ``stream``.

    Attributes:
        geometry, direction, num_blocks: what is copied.
        plan: merged descriptors (one per page here: ids are never adjacent).
        src, dst: source and destination tensors, each ``uint8 [pool_blocks, page_bytes]``.
        src_ids, dst_ids: int64 ``[num_blocks]``.
        stream: the stream the variant must enqueue on.
        driver: resolved driver entry points.
    """

    geometry: str
    direction: Direction
    num_blocks: int
    plan: TransferPlan
    src: list[torch.Tensor]
    dst: list[torch.Tensor]
    src_ids: np.ndarray
    dst_ids: np.ndarray
    stream: torch.cuda.Stream
    driver: CopyDriver


#: Prepares a case once (untimed) and returns the timed call that enqueues its copy on the stream.
Variant = Callable[[CopyCase], Callable[[], None]]


#: old variant name -> current one (``--variants`` still takes the old names, with a warning)
DEPRECATED_VARIANTS: dict[str, str] = {"batch_ctypes": "batch_c"}


def default_variants() -> dict[str, Variant]:
    """The per-page loop (``loop``) and both call paths of the batched copy: ``batch_c``, the
    resolved ``cuMemcpyBatchAsync`` called from C (``kvmgr.transfer.driver_call``) with the plan's
    int64 numpy buffers, through ctypes where that C module cannot be built or
    ``KVMGR_NATIVE_LAUNCH=0``; ``batch_lists``, cuda-python's binding with Python lists. (Until
    2026-12 ``batch_c`` was named ``batch_ctypes``, from when it always went through ctypes.)"""

    def loop(case: CopyCase) -> Callable[[], None]:
        p = case.plan
        return functools.partial(
            case.driver.loop, p.dst_addrs, p.src_addrs, p.sizes, case.stream.cuda_stream
        )

    def batch(call: str) -> Variant:
        def prepare(case: CopyCase) -> Callable[[], None]:
            p, order = case.plan, access_order(case.direction)
            fn = case.driver.batch_ctypes if call == "ctypes" else case.driver.batch_lists
            return functools.partial(
                fn, p.dst_addrs, p.src_addrs, p.sizes, case.stream.cuda_stream, order
            )

        return prepare

    return {"loop": loop, "batch_c": batch("ctypes"), "batch_lists": batch("lists")}


def select_variants(variants: dict[str, Variant], names: list[str] | None) -> dict[str, Variant]:
    """The ``--variants`` subset of ``variants`` in their order (all of them for ``None``); a
    name in ``DEPRECATED_VARIANTS`` stands for its current name and warns (``FutureWarning``).
    Names that are not columns on this machine (``kernel`` without Triton) are left out."""
    if not names:
        return variants
    wanted = set()
    for name in names:
        if name in DEPRECATED_VARIANTS:
            new = DEPRECATED_VARIANTS[name]
            warnings.warn(f"variant {name!r} is now named {new!r}", FutureWarning, stacklevel=2)
            name = new
        wanted.add(name)
    return {k: v for k, v in variants.items() if k in wanted}


def _released(issuer: object, case: CopyCase) -> Callable[[], None]:
    """``issuer.issue(plan, stream)`` as a timed call. Each call's table slot goes back to the
    pool once an event recorded after it has completed (checked with ``query``, never waited
    on), so back-to-back issues run as they do in an engine."""
    pending: collections.deque[tuple[torch.cuda.Event, Callable[[], None]]] = collections.deque()

    def issue() -> None:
        while pending and pending[0][0].query():
            pending.popleft()[1]()
        issued = issuer.issue(case.plan, case.stream)  # type: ignore[attr-defined]
        if issued.error is not None:
            raise issued.error
        if issued.release is not None:
            done = torch.cuda.Event()
            done.record(case.stream)
            pending.append((done, issued.release))

    return issue


def kernel_variant(programs: int | None = None, *, paged: bool = True) -> Variant:
    """The copy kernel as engine ``"kernel"`` issues it (table slot, upload, direct launch) at
    ``programs`` programs, or the per-direction defaults if ``None``. ``paged=False`` issues a
    hand-made copy of the plan (its descriptors, built before timing), so ``KernelCopy`` takes the
    descriptor table instead of the paged kernel's run table."""

    def prepare(case: CopyCase) -> Callable[[], None]:
        d2h = programs or DEFAULT_D2H_PROGRAMS
        h2d = programs or DEFAULT_H2D_PROGRAMS
        kernel = KernelCopy(case.stream.device, case.driver, d2h_programs=d2h, h2d_programs=h2d)
        if not paged:
            p = case.plan
            plan = TransferPlan(p.direction, p.src_addrs, p.dst_addrs, p.sizes)
            case = attrs.evolve(case, plan=plan)
        return _released(kernel, case)

    return prepare


def auto_variant(calibration: Calibration | None = None) -> Variant:
    """Engine ``"auto"``'s per-plan choice between the kernel and the DMA batch."""

    def prepare(case: CopyCase) -> Callable[[], None]:
        dma = DmaCopy(case.driver, "batch", 1 << 30)
        kernel = KernelCopy(case.stream.device, case.driver) if KERNEL_AVAILABLE else None
        return _released(ChoiceCopy(dma, kernel, cost_model(calibration or Calibration())), case)

    return prepare


def all_variants(calibration: Calibration | None = None) -> dict[str, Variant]:
    """``default_variants()`` plus ``kernel`` (paged), ``kernel_desc`` (the descriptor table)
    and ``auto`` (where Triton is installed)."""
    variants = default_variants()
    if KERNEL_AVAILABLE:
        variants |= {
            "kernel": kernel_variant(),
            "kernel_desc": kernel_variant(paged=False),
            "auto": auto_variant(calibration),
        }
    return variants


def time_issue(
    issue: Callable[[], None], stream: torch.cuda.Stream, args: argparse.Namespace
) -> tuple[float, float]:
    """Median (device us, host us) of ``issue`` on ``stream`` over ``args.repeats`` runs after
    ``args.warmup``; device time is between events recorded before and after the issue."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device_us, host_us = [], []
    for i in range(args.warmup + args.repeats):
        start.record(stream)
        t0 = time.perf_counter()
        issue()
        t1 = time.perf_counter()
        end.record(stream)
        end.synchronize()
        if i >= args.warmup:
            device_us.append(start.elapsed_time(end) * 1e3)
            host_us.append((t1 - t0) * 1e6)
    return statistics.median(device_us), statistics.median(host_us)


class CasePool:
    """GPU tensors and one registered host region of a geometry, ``2 * max_blocks + 1`` blocks
    each, random bytes on both sides; ``case()`` draws scattered (never adjacent) block ids."""

    def __init__(self, key: str, max_blocks: int, driver: CopyDriver) -> None:
        self.label, num_tensors, page = GEOMETRIES[key]
        self.size = 2 * max_blocks + 1
        self.gpu = [
            torch.randint(0, 256, (self.size, page), dtype=torch.uint8, device="cuda")
            for _ in range(num_tensors)
        ]
        self.buffer = PinnedHostBuffer(num_tensors * self.size * page)
        self.host = list(self.buffer.tensor.view(num_tensors, self.size, page).unbind(0))
        for h in self.host:
            h.copy_(torch.randint(0, 256, (self.size, page), dtype=torch.uint8, device="cuda"))
        self.layouts = {
            "gpu": KVLayout.from_tensors(self.gpu),
            "host": KVLayout.from_tensors(self.host),
        }
        self.stream, self.driver = torch.cuda.Stream(), driver

    def case(self, direction: Direction, blocks: int, rng: np.random.Generator) -> CopyCase:
        """``blocks`` random even block ids on each side (apart: one descriptor per page)."""
        ids = [2 * rng.choice(self.size // 2, blocks, replace=False) for _ in range(2)]
        src, dst = ("gpu", "host") if direction is Direction.D2H else ("host", "gpu")
        plan = build_plan(direction, self.layouts[src], self.layouts[dst], ids[0], ids[1])
        tensors = {"gpu": self.gpu, "host": self.host}
        return CopyCase(self.label, direction, blocks, plan, tensors[src], tensors[dst], ids[0],
                        ids[1], self.stream, self.driver)  # fmt: skip

    def __enter__(self) -> CasePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        torch.cuda.synchronize()
        self.buffer.close()


def verify(case: CopyCase, issue: Callable[[], None], poison: int) -> bool:
    """Poison the destination pages, copy once, compare with the source pages."""
    dst_ids = torch.from_numpy(case.dst_ids)
    src_ids = torch.from_numpy(case.src_ids)
    for t in case.dst:
        t[dst_ids.to(t.device)] = poison
    torch.cuda.synchronize()
    issue()
    case.stream.synchronize()
    return all(
        torch.equal(s[src_ids.to(s.device)].cuda(), d[dst_ids.to(d.device)].cuda())
        for s, d in zip(case.src, case.dst)
    )
