"""The c128 compressor as a step hook: always write state, compress only when a window completes.

Offers:
    C128CompressorHook   a :class:`kvmgr.hooks.StepHook` running the two c128 kernels of one
                         compressor layer once per scheduler step

Per step the hook launches :func:`~kvmgr.kernels.c128.api.c128_state_write`, then
:func:`~kvmgr.kernels.c128.api.c128_compress` unless the host gate
:func:`~kvmgr.kernels.c128.gate.c128_boundary` answers exactly ``False`` and the step is not being
captured into a CUDA graph. Under capture both kernels are always recorded: the graph is replayed
for later steps whose boundaries the capture cannot know, and the compress kernel skips
non-boundary tokens on the device.
"""

from __future__ import annotations

import operator
import time

import torch

from kvmgr.errors import GeometryError
from kvmgr.hooks import HookReport, StepContext
from kvmgr.kernels.c128.bounds import check_compress_bounds, check_write_bounds
from kvmgr.kernels.c128.gate import c128_boundary
from kvmgr.kernels.c128.host import Layer

__all__ = ["C128CompressorHook"]

_now = time.perf_counter

_STEP_TENSORS = (  # the order __call__ unpacks them in
    "positions",
    "c128.state_slot_mapping",
    "c128.state_block_table",
    "c128.req_indices",
    "c128.slot_mapping",
)


class C128CompressorHook:
    """One DeepSeek-V4 c128 compressor layer, run once per step by ``OffloadManager.step``.

    The hook owns the layer's persistent tensors (caches and learned weights) and reads the
    step's tensors from ``ctx.tensors`` (``T`` = tokens of the step, ``R`` = requests):

    ====================================  ===============================================
    ``"positions"``                       ``[T]`` int32/int64, absolute token positions
    ``"c128.state_slot_mapping"``         ``[T]`` int, state slot per token (< 0: padding)
    ``"c128.state_block_table"``          ``[R, W]`` int, state blocks per request
    ``"c128.req_indices"``                ``[T]`` int, each token's row of the block table
    ``"c128.slot_mapping"``               ``[T]`` int, compressed slot per token (< 0: skip)
    ``f"{name}.kv"``, ``f"{name}.score"``  ``[T, D]`` this layer's projections
    ====================================  ===============================================

    The first five are shared by every c128 layer of the model; ``kv``/``score`` are keyed by
    the hook's ``name`` so that several layers (hooks) can run in one step. The gate reads
    ``ctx.num_computed_tokens`` and ``ctx.query_start_loc`` (host arrays).

    Attributes:
        name: the hook's name (also the key prefix of its ``kv``/``score`` tensors).
        gated: whether the host gate may skip the compress launch (``False`` gives the ungated
            baseline that always launches both kernels).
        state_cache: the layer's state cache (mutated in place every step).
        compressed_cache: the layer's compressed cache (mutated at boundary slots).
        num_steps: steps run so far (total).
        num_launches: kernel launches issued so far (total, both kernels).
        num_skips: compress launches skipped by the gate so far (total).
    """

    def __init__(
        self,
        *,
        state_cache: torch.Tensor,
        compressed_cache: torch.Tensor,
        ape: torch.Tensor,
        norm_weight: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        eps: float = 1e-6,
        name: str = "c128",
        gated: bool = True,
        check_slots: bool = False,
        direct_launch: bool = True,
    ) -> None:
        """Check and keep one layer's tensors; each step then checks only its own tensors.

        Args:
            state_cache: ``[num_state_blocks, S, 2D]`` fp32 state cache (mutated each step).
            compressed_cache: ``[num_blocks, block_size, D + 64 + D // 64]`` uint8 (mutated at
                boundary steps).
            ape: ``[128, D]`` fp32 learned position bias of the scores.
            norm_weight: ``[D]`` RMSNorm weight.
            cos_sin_cache: ``[max_positions, 64]`` fp32 RoPE table (32 cos, 32 sin).
            eps: RMSNorm epsilon (> 0).
            name: hook name and tensor-key prefix.
            gated: ``False`` disables the host gate (baseline for benchmarks).
            check_slots: check every step's slots, table rows and table entries against the
                caches and raise :class:`~kvmgr.errors.InvalidBlockError` for an index the
                device would skip (one device->host sync per kernel; not under capture).
            direct_launch: bind each kernel's launch once per step signature and launch it with
                ``cuLaunchKernelEx`` from packed arguments (:mod:`kvmgr.kernels.launch`; the
                default). ``False`` takes Triton's own launch on every step.

        Raises:
            GeometryError: a layer tensor has the wrong type, shape, dtype, device or layout,
                or ``eps <= 0``.
            ImportError: Triton is not installed.
        """
        self._layer = Layer(state_cache, ape=ape, norm_weight=norm_weight,
                             cos_sin_cache=cos_sin_cache, compressed_cache=compressed_cache,
                             eps=eps, direct_launch=direct_launch)  # fmt: skip
        self.name = name
        self.gated = gated
        self.check_slots = check_slots
        self.state_cache = state_cache
        self.compressed_cache = compressed_cache
        self.num_steps = 0
        self.num_launches = 0
        self.num_skips = 0
        self._keys = (*_STEP_TENSORS, f"{name}.kv", f"{name}.score")
        self._step_tensors = operator.itemgetter(*self._keys)

    def __call__(self, ctx: StepContext) -> HookReport:
        """Enqueue this step's state write and, unless gated off, its compression.

        The host work per step is O(1) in the layer (its tensors were checked at
        construction): key lookups, attribute reads of the step tensors, the gate (a scan of
        ``num_reqs`` ints) and the launches; no tensor is created and the device is not read.

        Returns:
            A report with ``launches`` (2; 1 when gated off; 0 for an empty step), ``skips``
            (0 or 1) and ``extra`` holding
            ``boundary`` (the gate's answer, ``None`` when not asked) and ``num_tokens``.

        Raises:
            GeometryError: a step tensor is missing or malformed, or the gate's metadata is
                malformed (nothing was launched).
            InvalidBlockError: ``check_slots`` and an index is out of range (nothing was
                launched).
            ConfigError: ``check_slots`` under CUDA-graph capture. The compress inputs are only checked when
                the compress launch is issued.
        """
        start_s = _now()
        try:
            pos, state_slots, table, req, slots, kv, score = self._step_tensors(ctx.tensors)
        except KeyError:
            missing = [k for k in self._keys if k not in ctx.tensors]
            got = sorted(ctx.tensors)
            raise GeometryError(f"ctx.tensors: expected keys {missing}, got {got}") from None
        boundary = None
        if self.gated and not ctx.is_capturing:
            boundary = c128_boundary(ctx.num_computed_tokens, ctx.query_start_loc)
        skip = boundary is False
        layer = self._layer
        if skip and not self.check_slots:  # the gated step: one launch, checked just before
            num_tokens = layer.launch_write(kv, score, pos, state_slots, ctx.stream)
            launches = 1 if num_tokens else 0
        else:  # validate everything that will launch before launching anything
            write, num_tokens = layer.prepare_write(kv, score, pos, state_slots)
            if not skip:
                compress, _ = layer.prepare_compress(table, req, pos, slots)
            if self.check_slots:
                check_write_bounds(layer, pos, state_slots)
                if not skip:
                    check_compress_bounds(layer, table, req, pos, slots)
            launches = 0
            if num_tokens:
                grid, stream = (num_tokens, 1, 1), ctx.stream
                write.launch(grid, stream)
                launches = 1
                if not skip:
                    compress.launch(grid, stream)
                    launches = 2
        self.num_steps += 1
        self.num_launches += launches
        self.num_skips += skip
        return HookReport.of(self.name, launches, int(skip), _now() - start_s,
                             {"boundary": boundary, "num_tokens": num_tokens})  # fmt: skip
