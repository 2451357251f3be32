"""Host side of the c128 kernels: tensor checks, bounds checks and launches (private).

Offers (to :mod:`kvmgr.kernels.c128.api` and :mod:`kvmgr.kernels.c128.hook`):
    Layer   one compressor layer's tensors, checked once; per-step checks and launches

Dependencies: :mod:`~kvmgr.kernels.c128.kernel`, :mod:`~kvmgr.kernels.c128.layout` and
:mod:`kvmgr.kernels.launch` (each kernel's bound launches: :class:`~kvmgr.kernels.launch.Launches`,
keyed by the step signature and the specialization rule's classes); nothing above.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmgr._tensor_guard import any_meta
from kvmgr.kernels.c128._steady import WriteGuard
from kvmgr.kernels.c128.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check,
    count_tokens,
    fail,
    is_index,
    is_rows,
)
from kvmgr.kernels.c128.kernel import HAS_TRITON, WINDOW_CHUNK, compress_kernel, state_write_kernel
from kvmgr.kernels.c128.layout import C128_RATIO, C128_ROPE_DIM, c128_entry_bytes
from kvmgr.kernels.launch import Launches
from kvmgr.kernels.launch.rule import Unsupported

__all__ = ["Layer"]

# the arguments a step changes: kv, score, positions, state slots, kv and score row strides
_WRITE_VARYING = (0, 1, 3, 4, 6, 7)
# table, req_indices, positions, compressed slots, table row stride, table rows and width
_COMPRESS_VARYING = (1, 2, 3, 4, 10, 12, 13)


class Layer:
    """One compressor layer's tensors, checked once; per-step checks and launches.

    ``check_*`` validate a step's tensors with attribute reads only (no tensor is created, no
    device is touched, nothing is re-derived from the layer) and return the token count; only
    when a check fails is the slow path run that names the offending tensor. ``launch_*``
    enqueue a kernel without checking, so a caller checks everything a step needs first.
    Tensors left ``None`` are not checked and must not be needed by the launches asked for.
    Each kernel's launches are bound per step signature (:class:`~kvmgr.kernels.launch.Launches`
    of this layer; the compiled kernels are shared by every layer): packed launches through
    ``cuLaunchKernelEx``, or Triton's own launch with ``direct_launch=False``.
    """

    def __init__(
        self, state_cache: object, *, ape: object = None, norm_weight: object = None,
        cos_sin_cache: object = None, compressed_cache: object = None, eps: float = 1e-6,
        direct_launch: bool = True,
    ) -> None:  # fmt: skip
        if not HAS_TRITON:
            raise ImportError("the c128 kernels need Triton: pip install 'kvmgr[kernels]'")
        dims: tuple[int, ...] = tuple(getattr(state_cache, "shape", ()))
        if len(dims) != 3:
            raise fail("state_cache", "shape [num_state_blocks, S, 2D]", list(dims))
        self.block_size, self.head_dim = dims[1], dims[2] // 2
        self.entry_bytes = c128_entry_bytes(self.head_dim)
        d = self.head_dim
        self.state_cache = check(state_cache, "state_cache", (None, None, 2 * d),
                                  (torch.float32,), None)  # fmt: skip
        self.device = self.state_cache.device
        if self.device.type == "meta":  # storage-less: a launch would read address 0
            raise fail("state_cache", "a tensor with storage (cuda, or cpu interpreted)", "meta")
        # CPU memory (interpreted kernels): a key's device index -1 also fits a meta tensor
        self._on_cpu = self.device.type == "cpu"
        self.state_strides = (self.state_cache.stride(0), self.state_cache.stride(1))
        self.num_state_blocks = dims[0]
        self.state_capacity = dims[0] * dims[1]
        dev, f32 = self.device, (torch.float32,)
        if ape is not None:
            self.ape = check(ape, "ape", (C128_RATIO, d), f32, dev, contiguous=True)
        if norm_weight is not None:
            self.norm_weight = check(norm_weight, "norm_weight", (d,), FLOAT_DTYPES, dev,
                                      contiguous=True)  # fmt: skip
        if cos_sin_cache is not None:
            self.cos_sin_cache = check(cos_sin_cache, "cos_sin_cache", (None, C128_ROPE_DIM),
                                        f32, dev, contiguous=True)  # fmt: skip
            self.num_rope_positions = self.cos_sin_cache.shape[0]
        if compressed_cache is not None:
            self.compressed_cache = check(compressed_cache, "compressed_cache",
                                           (None, None, self.entry_bytes), (torch.uint8,), dev,
                                           contiguous=True)  # fmt: skip
            self.compressed_capacity = (
                self.compressed_cache.shape[0] * self.compressed_cache.shape[1]
            )
        if not (isinstance(eps, float | int) and eps > 0):
            raise fail("eps", "a float > 0", eps)
        self.eps = float(eps)
        self._write = Launches(state_write_kernel, _WRITE_VARYING, "ttttii", direct=direct_launch)
        self._compress = Launches(compress_kernel, _COMPRESS_VARYING, "ttttiii", num_warps=4,
                                  direct=direct_launch)  # fmt: skip
        # the last step's tensors, their pointers and T, and its bound launch: a step that
        # passes the very same tensor objects (persistent buffers) skips even the signature
        self._last_write: tuple[Any, ...] | None = None
        # a steady loop's new step tensors: the state write by one C++ check (_steady)
        self._steady_write = WriteGuard()
        self._last_compress: tuple[Any, ...] | None = None

    def check_write(self, kv: object, score: object, positions: object, state_slot_mapping: object) -> int:  # fmt: skip
        """Validate the step tensors of :func:`c128_state_write`; return ``T``.

        Raises:
            GeometryError: a tensor has the wrong type, shape, dtype, device or layout.
        """
        dev, num_tokens = self.device, count_tokens(positions)
        if not (
            is_index(positions, num_tokens, dev)
            and is_index(state_slot_mapping, num_tokens, dev)
            and is_rows(kv, num_tokens, self.head_dim, FLOAT_DTYPES, dev)
            and is_rows(score, num_tokens, self.head_dim, (kv.dtype,), dev)
        ):
            self._tokens(positions, state_slot_mapping=state_slot_mapping)
            kv = check(kv, "kv", (num_tokens, self.head_dim), FLOAT_DTYPES, dev)
            check(score, "score", (num_tokens, self.head_dim), (kv.dtype,), dev)
        return num_tokens

    def check_compress(self, state_block_table: object, req_indices: object, positions: object, compressed_slot_mapping: object) -> int:  # fmt: skip
        """Validate the step tensors of :func:`c128_compress`; return ``T``.

        Raises:
            GeometryError: a tensor has the wrong type, shape, dtype, device or layout.
        """
        dev, num_tokens = self.device, count_tokens(positions)
        table = state_block_table
        if not (
            isinstance(table, torch.Tensor)
            and table.dim() == 2
            and table.dtype in INDEX_DTYPES
            and table.device == dev
            and (table.numel() == 0 or table.stride(1) == 1)
            and is_index(positions, num_tokens, dev)
            and is_index(req_indices, num_tokens, dev)
            and is_index(compressed_slot_mapping, num_tokens, dev)
        ):
            check(table, "state_block_table", (None, None), INDEX_DTYPES, dev)
            self._tokens(positions, req_indices=req_indices,
                         compressed_slot_mapping=compressed_slot_mapping)  # fmt: skip
        return num_tokens

    def _tokens(self, positions: object, **index_tensors: object) -> None:
        """Slow path: raise for the first malformed ``[T]`` index tensor."""
        num_tokens = check(positions, "positions", (None,), INDEX_DTYPES, self.device).shape[0]
        for name, t in index_tensors.items():
            check(t, name, (num_tokens,), INDEX_DTYPES, self.device)

    def prepare_write(self, kv: Any, score: Any, positions: Any, state_slot_mapping: Any) -> tuple[Any, int]:  # fmt: skip
        """The state write's bound launch with this step's arguments set, and ``T``.

        Checks (:meth:`check_write`) run once per step signature: ranks, the sizes other than
        ``T``, devices, strides (``T`` excluded) and the rule's classes (dtypes, pointer
        alignments, stride classes); a repeated signature only compares ``T`` across the
        tensors, and a step that passes the same tensor objects as the last one (with the same
        ``data_ptr()``s and ``T``; in-place metadata changes such as ``set_`` between steps are
        not seen) skips even that. Nothing is enqueued; ``(None, 0)`` for an empty step.

        Raises:
            GeometryError: as :meth:`check_write`.
        """
        hit = self._repeated_write(kv, score, positions, state_slot_mapping)
        if hit is not None:
            return hit[5], hit[4][-1]
        try:
            kvs, scs, ps, ss = kv.shape, score.shape, positions.shape, state_slot_mapping.shape  # fmt: skip
            kvt, sct = kv.stride(), score.stride()
            num_tokens = ps[0]
            args = (kv, score, positions, state_slot_mapping, kvt[0], sct[0])
            classes, values = self._write.read(*args)
            key: Any = (
                classes, len(ps), positions.get_device(), positions.stride()[0], len(ss),
                state_slot_mapping.get_device(), state_slot_mapping.stride()[0], len(kvs), kvs[1],
                kvt[1], kv.get_device(), len(scs), scs[1], sct[1], score.get_device(),
            )  # fmt: skip
            same = num_tokens > 0 and kvs[0] == num_tokens == scs[0] == ss[0]
            bound = self._write.get(key) if same else None
            if bound is not None and self._on_cpu and any_meta(kv, score, positions, state_slot_mapping):  # fmt: skip
                bound = None  # the checks refuse it (their device is the state cache's)
        except (AttributeError, IndexError, TypeError, Unsupported):  # not the expected ranks
            key, bound = None, None
        if bound is None:
            num_tokens = self.check_write(kv, score, positions, state_slot_mapping)
            if num_tokens == 0:
                return None, 0
            args = (kv, score, positions, state_slot_mapping, kv.stride(0), score.stride(0))
            classes, values = self._write.read(*args)
            full = (kv, score, self.ape, positions, state_slot_mapping, self.state_cache,
                    *args[4:], *self.state_strides, self.state_capacity, self.block_size,
                    self.head_dim, C128_RATIO)  # fmt: skip
            bound = self._write.bind(classes if key is None else key, (num_tokens, 1, 1), full)
            self._steady_write.forget()
        else:
            self._steady_write.remember(key, bound, args, values)
        bound.set(values, args)
        self._last_write = (kv, score, positions, state_slot_mapping, (*values[:4], num_tokens),
                            bound, (num_tokens, 1, 1))  # fmt: skip
        return bound, num_tokens

    def _repeated_write(self, kv: Any, score: Any, positions: Any, state_slot_mapping: Any) -> tuple[Any, ...] | None:  # fmt: skip
        """The last-write record of a step that needs no key, its arguments set: the very
        tensor objects of the last step, or a step that passes the write guard; else None."""
        last = self._last_write  # the same tensor objects as the last step: nothing to redo
        if (
            last is not None and kv is last[0] and score is last[1] and positions is last[2]
            and state_slot_mapping is last[3] and last[4] == (kv.data_ptr(), score.data_ptr(),
            positions.data_ptr(), state_slot_mapping.data_ptr(), positions.numel())
        ):  # fmt: skip
            return last
        hit = self._steady_write.launch(kv, score, positions, state_slot_mapping, None, False)
        if hit is not None:
            self._last_write = hit
        return hit

    def prepare_compress(self, state_block_table: Any, req_indices: Any, positions: Any, compressed_slot_mapping: Any) -> tuple[Any, int]:  # fmt: skip
        """The compress kernel's bound launch with this step's arguments set, and ``T``.

        As :meth:`prepare_write`; the table's row count, width and row stride are runtime
        arguments, not part of the signature (an empty table is checked every time).

        Raises:
            GeometryError: as :meth:`check_compress`.
        """
        table, req, pos, slots = state_block_table, req_indices, positions, compressed_slot_mapping
        last = self._last_compress
        if (
            last is not None and table is last[0] and req is last[1] and pos is last[2]
            and slots is last[3] and last[4] == (table.data_ptr(), req.data_ptr(),
            pos.data_ptr(), slots.data_ptr(), table.shape, pos.shape[0])
        ):  # fmt: skip
            return last[5], last[4][-1]
        try:
            tsh, ts, ps, rs, ss = table.shape, table.stride(), pos.shape, req.shape, slots.shape
            num_tokens, (num_reqs, width) = ps[0], tsh
            args = (table, req, pos, slots, ts[0], num_reqs, width)
            classes, values = self._compress.read(*args)
            key: Any = (
                classes, table.get_device(), ts[1], len(ps), pos.get_device(), pos.stride()[0],
                len(rs), req.get_device(), req.stride()[0], len(ss), slots.get_device(),
                slots.stride()[0],
            )  # fmt: skip
            same = num_tokens > 0 and num_reqs * width > 0 and rs[0] == num_tokens == ss[0]
            bound = self._compress.get(key) if same else None
            if bound is not None and self._on_cpu and any_meta(table, req, pos, slots):
                bound = None  # as in prepare_write
        except (AttributeError, IndexError, TypeError, ValueError, Unsupported):  # other ranks
            key, bound = None, None
        if bound is None:
            num_tokens = self.check_compress(table, req, pos, slots)
            if num_tokens == 0:
                return None, 0
            num_reqs, width = table.shape
            args = (table, req, pos, slots, table.stride(0), num_reqs, width)
            classes, values = self._compress.read(*args)
            full = (self.state_cache, table, req, pos, slots, self.norm_weight,
                    self.cos_sin_cache, self.compressed_cache, *self.state_strides,
                    table.stride(0), self.eps, num_reqs, width, self.num_state_blocks,
                    self.num_rope_positions, self.compressed_capacity, self.block_size,
                    self.head_dim, C128_ROPE_DIM, C128_RATIO, WINDOW_CHUNK, self.entry_bytes)  # fmt: skip
            bound = self._compress.bind(classes if key is None else key, (num_tokens, 1, 1), full)
        bound.set(values, args)
        self._last_compress = (table, req, pos, slots, (*values[:4], table.shape, num_tokens), bound)  # fmt: skip
        return bound, num_tokens

    def launch_write(self, kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor, state_slot_mapping: torch.Tensor, stream: torch.cuda.Stream | None = None) -> int:  # fmt: skip
        """Check (cached) and enqueue the state write on ``stream`` (current if None); ``T``."""
        last = self._last_write  # as prepare_write's first test, without the call
        if (
            last is not None and kv is last[0] and score is last[1] and positions is last[2]
            and state_slot_mapping is last[3] and last[4] == (kv.data_ptr(), score.data_ptr(),
            positions.data_ptr(), state_slot_mapping.data_ptr(), positions.numel())
        ):  # fmt: skip
            last[5].launch(last[6], stream)
            return last[4][-1]
        hit = self._steady_write.launch(kv, score, positions, state_slot_mapping, stream, True)
        if hit is not None:
            self._last_write = hit
            return hit[4][-1]  # type: ignore[no-any-return]
        bound, num_tokens = self.prepare_write(kv, score, positions, state_slot_mapping)
        if num_tokens:
            bound.launch((num_tokens, 1, 1), stream)
        return num_tokens

    def launch_compress(self, state_block_table: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor, compressed_slot_mapping: torch.Tensor, stream: torch.cuda.Stream | None = None) -> int:  # fmt: skip
        """Check (cached) and enqueue the compression of every candidate token; ``T``."""
        bound, num_tokens = self.prepare_compress(state_block_table, req_indices, positions, compressed_slot_mapping)  # fmt: skip
        if num_tokens:
            bound.launch((num_tokens, 1, 1), stream)
        return num_tokens
