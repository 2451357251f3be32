"""DeepSeek-V4 c128 KV compressor: state write and windowed compression (Triton).

Offers:
    c128_state_write         every token writes ``[kv | score + ape[pos % 128]]`` (fp32) into a
                             paged state cache (Triton)
    c128_compress            every boundary token (``(pos + 1) % 128 == 0``) pools its request's
                             last 128 state rows into one compressed entry (Triton)
    c128_entry_bytes         bytes of one compressed entry (584 for head dim 512)
    c128_boundary            the host gate, re-exported from :mod:`kvmgr.kernels.c128_gate`

Torch references of both kernels, the unpacker and a RoPE table builder are in
:mod:`kvmgr.kernels.c128_ref`; the step hook is in :mod:`kvmgr.kernels.c128_hook`. Launches go
through :class:`kvmgr.kernels._launch.DirectLauncher` (``direct_launch=False``: Triton's own).

Compression of one boundary token at position ``pos`` of request ``r``:

1. gather the state rows of positions ``pos-127 .. pos`` through ``state_block_table[r]``
   (position ``p`` lives in block ``state_block_table[r, p // S]``, row ``p % S``, where ``S``
   is the state block size);
2. per channel ``c``: ``pooled[c] = sum_i softmax_i(score[i, c]) * kv[i, c]`` over the 128 rows;
3. RMSNorm in fp32: ``y = pooled * rsqrt(mean(pooled**2) + eps) * norm_weight``;
4. interleaved-pair RoPE on the last 64 dims (pairs ``(2i, 2i+1)``) at rotation position
   ``(pos // 128) * 128``, reading ``cos_sin_cache[rotation position]``;
5. quantize and store at the token's compressed slot.

Compressed entry layout (one token; ``D = head_dim``, ``G = D // 64``, of which ``G - 1`` NoPE
groups of 64 dims; the column shows D = 512)::

    bytes [0, D-64)        [0, 448)     NoPE dims 0..D-65 as FP8 e4m3fn; group g = dims
                                        64g .. 64g+63, stored as fp8(clamp(x * 2**-e_g, -448, 448))
    bytes [D-64, D+64)     [448, 576)   RoPE dims D-64..D-1 as bf16, little-endian, in dim order
    bytes [D+64, D+63+G)   [576, 583)   one UE8M0 byte per NoPE group: e_g + 127
    byte  D+63+G           583          zero pad
    total D + 64 + G                    584 bytes

``e_g = ceil(log2(max(amax_g, 1e-4) / 448))`` with ``amax_g`` the group's largest ``|x|``, so the
dequantized value is ``fp8 * 2**e_g``. Entries are rows of a contiguous uint8 cache
``[num_blocks, block_size, entry_bytes]``; compressed slot ``s`` is block ``s // block_size``,
row ``s % block_size``.

Kernel inputs, per candidate token ``i`` (any subset of the step's tokens; under CUDA-graph
capture pass all of them): ``positions[i]`` (absolute position), ``req_indices[i]`` (its row of
``state_block_table``) and ``compressed_slot_mapping[i]``. The compress kernel skips, on the
device, tokens that are not at a boundary or have a negative slot, so one launch over every
token of a step is always correct; the host gate only decides whether launching can be skipped.

Bounds: neither kernel reads or writes outside the tensors it was given. On the device, a state
slot or compressed slot outside ``[0, capacity)``, a negative position, a ``req_indices`` entry
outside the table's rows, a window whose block index reaches past the table row's width, a table
entry outside ``[0, num_state_blocks)`` and a RoPE position past the cos/sin table all make the
token write nothing. ``check_slots=True`` (the launchers and the hook) raises
:class:`~kvmgr.errors.InvalidBlockError` for those instead, at the cost of one device->host sync.

Without Triton this module still imports (the layout helpers work) and the launchers raise
``ImportError``; the gate lives in a numpy-only module that ``import kvmgr`` exports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

import torch

from kvmgr.errors import ConfigError, GeometryError, InvalidBlockError
from kvmgr.kernels._launch import shared_launcher
from kvmgr.kernels.c128_gate import C128_RATIO, c128_boundary

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

__all__ = [
    "C128_RATIO",
    "C128_ROPE_DIM",
    "c128_boundary",
    "c128_compress",
    "c128_entry_bytes",
    "c128_state_write",
]

C128_ROPE_DIM = 64
_GROUP = 64  # dims per FP8 scale group (the kernel spells out 64, 448 and the 1e-4 floor)
_WINDOW_CHUNK = 8  # state rows the compress kernel pools per loop iteration


def _jit(**options: Any) -> Callable[[Callable[..., None]], Any]:
    """``triton.jit(**options)`` where Triton is installed; the plain function otherwise."""

    def wrap(fn: Callable[..., None]) -> Any:
        return triton.jit(fn, **options) if triton is not None else fn

    return wrap


@_jit()
def _state_write_kernel(  # type: ignore[no-untyped-def]
    kv_ptr, score_ptr, ape_ptr, pos_ptr, slot_ptr, state_ptr,
    stride_kv, stride_score, stride_state_block, stride_state_row, state_capacity,
    STATE_BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, RATIO: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    # 1. padding tokens (slot < 0), slots past the cache and negative positions write nothing
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    if (slot < 0) | (slot >= state_capacity) | (pos < 0):
        return
    offs = tl.arange(0, HEAD_DIM)
    # 2. the row: kv as fp32, score plus the learned position bias of pos % RATIO
    kv = tl.load(kv_ptr + tok * stride_kv + offs).to(tl.float32)
    score = tl.load(score_ptr + tok * stride_score + offs).to(tl.float32)
    ape = tl.load(ape_ptr + (pos % RATIO) * HEAD_DIM + offs)
    row = (
        state_ptr
        + (slot // STATE_BLOCK_SIZE) * stride_state_block
        + (slot % STATE_BLOCK_SIZE) * stride_state_row
    )
    tl.store(row + offs, kv)
    tl.store(row + HEAD_DIM + offs, score + ape)


# the table's shape varies with the step's requests: never recompile for it
@_jit(do_not_specialize=["stride_table", "num_reqs", "table_width"])
def _compress_kernel(  # type: ignore[no-untyped-def]
    state_ptr, table_ptr, req_ptr, pos_ptr, slot_ptr, weight_ptr, cos_sin_ptr, out_ptr,
    stride_state_block, stride_state_row, stride_table, eps,
    num_reqs, table_width, num_state_blocks, num_rope_positions, compressed_capacity,
    STATE_BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    RATIO: tl.constexpr, WINDOW_CHUNK: tl.constexpr, ENTRY_BYTES: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    # 1. only boundary tokens with a real slot compress; everything else leaves at once. A token
    #    whose slot, table row, window blocks or RoPE row lie outside the tensors it was given
    #    is skipped too (pos >= RATIO - 1 also keeps the window's first position >= 0).
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    if ((pos + 1) % RATIO != 0) | (pos < RATIO - 1):
        return
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    req = tl.load(req_ptr + tok).to(tl.int64)
    bad = (slot < 0) | (slot >= compressed_capacity) | (req < 0) | (req >= num_reqs)
    bad = bad | (pos // STATE_BLOCK_SIZE >= table_width)
    if bad | ((pos // RATIO) * RATIO >= num_rope_positions):
        return
    offs_d = tl.arange(0, HEAD_DIM)
    offs_w = tl.arange(0, WINDOW_CHUNK)
    # 2. online per-channel softmax pooling over the window, WINDOW_CHUNK rows at a time
    run_max = tl.full([HEAD_DIM], float("-inf"), tl.float32)
    run_sum = tl.zeros([HEAD_DIM], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    num_bad = 0  # window rows whose table entry is not a state block: the token is skipped
    for w0 in range(0, RATIO, WINDOW_CHUNK):
        p = pos - (RATIO - 1) + w0 + offs_w
        blk = tl.load(table_ptr + req * stride_table + p // STATE_BLOCK_SIZE).to(tl.int64)
        is_block = (blk >= 0) & (blk < num_state_blocks)
        num_bad += tl.sum((~is_block).to(tl.int32), axis=0)
        blk = tl.where(is_block, blk, 0)
        rows = state_ptr + blk * stride_state_block + (p % STATE_BLOCK_SIZE) * stride_state_row
        kv = tl.load(rows[:, None] + offs_d[None, :], mask=is_block[:, None], other=0.0)
        score = tl.load(rows[:, None] + HEAD_DIM + offs_d[None, :], mask=is_block[:, None],
                        other=0.0)  # fmt: skip
        new_max = tl.maximum(run_max, tl.max(score, axis=0))
        alpha = tl.exp(run_max - new_max)
        weight = tl.exp(score - new_max[None, :])
        run_sum = run_sum * alpha + tl.sum(weight, axis=0)
        acc = acc * alpha + tl.sum(weight * kv, axis=0)
        run_max = new_max
    if num_bad > 0:
        return
    pooled = acc / run_sum
    # 3. RMSNorm in fp32 with the learned weight
    inv_rms = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=0) / HEAD_DIM + eps)
    y = pooled * inv_rms * tl.load(weight_ptr + offs_d).to(tl.float32)
    # 4. interleaved-pair RoPE on the last ROPE_DIM dims; NoPE pairs get cos 1, sin 0
    even, odd = tl.split(tl.reshape(y, [HEAD_DIM // 2, 2]))
    pair = tl.arange(0, HEAD_DIM // 2) - (HEAD_DIM - ROPE_DIM) // 2
    is_rope = pair >= 0
    cs_row = cos_sin_ptr + (pos // RATIO) * RATIO * ROPE_DIM  # rows are contiguous [cos | sin]
    cos = tl.load(cs_row + pair, mask=is_rope, other=1.0)
    sin = tl.load(cs_row + ROPE_DIM // 2 + pair, mask=is_rope, other=0.0)
    y = tl.reshape(tl.join(even * cos - odd * sin, even * sin + odd * cos), [HEAD_DIM])
    # 5. UE8M0 exponent per 64-dim group, exact from the fp32 bits of amax:
    #    amax = m * 2**E, m in [1, 2): ceil(log2(amax / 448)) = E - 8 + (m > 1.75)
    groups = tl.reshape(y, [HEAD_DIM // 64, 64])
    amax = tl.maximum(tl.max(tl.abs(groups), axis=1), 1e-4)
    bits = amax.to(tl.int32, bitcast=True)
    expo = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    inv_scale = ((127 - expo) << 23).to(tl.float32, bitcast=True)
    q = tl.clamp(groups * inv_scale[:, None], -448.0, 448.0).to(tl.float8e4nv)
    # 6. store: FP8 NoPE groups, bf16 RoPE tail, scale bytes with the RoPE group's byte zero
    entry = out_ptr + slot * ENTRY_BYTES
    offs_g = tl.arange(0, HEAD_DIM // 64)
    is_nope = offs_g < (HEAD_DIM - ROPE_DIM) // 64
    grid = offs_g[:, None] * 64 + tl.arange(0, 64)[None, :]
    tl.store(entry + grid, q.to(tl.uint8, bitcast=True), mask=is_nope[:, None])
    rope_ptr = (entry + HEAD_DIM - ROPE_DIM).to(tl.pointer_type(tl.bfloat16))
    rope_offs = offs_d - (HEAD_DIM - ROPE_DIM)
    tl.store(rope_ptr + rope_offs, y.to(tl.bfloat16), mask=rope_offs >= 0)
    scale_bytes = tl.where(is_nope, expo + 127, 0).to(tl.uint8)
    tl.store(entry + HEAD_DIM + ROPE_DIM + offs_g, scale_bytes)


def c128_entry_bytes(head_dim: int = 512) -> int:
    """Bytes of one compressed entry: ``head_dim + 64 + head_dim // 64`` (584 for 512).

    Raises:
        GeometryError: ``head_dim`` is not a power of two >= 128.
    """
    if head_dim < 128 or head_dim & (head_dim - 1):
        raise GeometryError(f"head_dim: expected a power of two >= 128, got {head_dim}")
    return head_dim + C128_ROPE_DIM + head_dim // _GROUP


_INDEX = (torch.int32, torch.int64)
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def _fail(name: str, expected: str, got: object) -> GeometryError:
    return GeometryError(f"{name}: expected {expected}, got {got}")


def _check(
    t: object, name: str, shape: tuple[int | None, ...], dtypes: tuple[torch.dtype, ...],
    device: torch.device | None, *, contiguous: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Check type, sizes (``None``: any), dtype, device and unit last stride; return ``t``."""
    if not isinstance(t, torch.Tensor):
        raise _fail(name, "a torch.Tensor", type(t).__name__)
    if t.dim() != len(shape) or any(
        s not in (None, n) for s, n in zip(shape, t.shape, strict=False)
    ):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise _fail(name, f"shape {want}", list(t.shape))
    if t.dtype not in dtypes:
        raise _fail(name, "dtype in " + "/".join(str(d) for d in dtypes), t.dtype)
    if device is not None and t.device != device:
        raise _fail(name, f"device {device}", t.device)
    if contiguous and not t.is_contiguous():
        raise _fail(name, "a contiguous tensor", f"strides {t.stride()}")
    if t.numel() and t.stride(-1) != 1:
        raise _fail(name, "unit last stride", f"strides {t.stride()}")
    return t


def _is_index(t: object, num_tokens: int, device: torch.device) -> TypeGuard[torch.Tensor]:
    """Whether ``t`` passes ``_check(t, name, (num_tokens,), _INDEX, device)``; no allocation."""
    return (
        isinstance(t, torch.Tensor)
        and t.shape == (num_tokens,)
        and t.dtype in _INDEX
        and t.device == device
        and (num_tokens == 0 or t.stride(0) == 1)
    )


def _is_rows(
    t: object, num_tokens: int, width: int, dtypes: tuple[torch.dtype, ...], device: torch.device
) -> TypeGuard[torch.Tensor]:
    """Whether ``t`` passes ``_check(t, name, (num_tokens, width), dtypes, device)``."""
    return (
        isinstance(t, torch.Tensor)
        and t.shape == (num_tokens, width)
        and t.dtype in dtypes
        and t.device == device
        and (num_tokens == 0 or t.stride(1) == 1)
    )


class _Layer:
    """One compressor layer's tensors, checked once; per-step checks and launches.

    ``check_*`` validate a step's tensors with attribute reads only (no tensor is created, no
    device is touched, nothing is re-derived from the layer) and return the token count; only
    when a check fails is the slow path run that names the offending tensor. ``launch_*``
    enqueue a kernel without checking, so a caller checks everything a step needs first.
    Tensors left ``None`` are not checked and must not be needed by the launches asked for.
    Both kernels launch through the process-wide :func:`~kvmgr.kernels._launch.shared_launcher`
    of their kernel: direct launches, or Triton's normal launch with ``direct_launch=False``.
    """

    def __init__(
        self, state_cache: object, *, ape: object = None, norm_weight: object = None,
        cos_sin_cache: object = None, compressed_cache: object = None, eps: float = 1e-6,
        direct_launch: bool = True,
    ) -> None:  # fmt: skip
        if triton is None:
            raise ImportError("the c128 kernels need Triton: pip install 'kvmgr[kernels]'")
        dims: tuple[int, ...] = tuple(getattr(state_cache, "shape", ()))
        if len(dims) != 3:
            raise _fail("state_cache", "shape [num_state_blocks, S, 2D]", list(dims))
        self.block_size, self.head_dim = dims[1], dims[2] // 2
        self.entry_bytes = c128_entry_bytes(self.head_dim)
        d = self.head_dim
        self.state_cache = _check(state_cache, "state_cache", (None, None, 2 * d),
                                  (torch.float32,), None)  # fmt: skip
        self.device = self.state_cache.device
        self.state_strides = (self.state_cache.stride(0), self.state_cache.stride(1))
        self.num_state_blocks = dims[0]
        self.state_capacity = dims[0] * dims[1]
        dev, f32 = self.device, (torch.float32,)
        if ape is not None:
            self.ape = _check(ape, "ape", (C128_RATIO, d), f32, dev, contiguous=True)
        if norm_weight is not None:
            self.norm_weight = _check(norm_weight, "norm_weight", (d,), _FLOAT, dev,
                                      contiguous=True)  # fmt: skip
        if cos_sin_cache is not None:
            self.cos_sin_cache = _check(cos_sin_cache, "cos_sin_cache", (None, C128_ROPE_DIM),
                                        f32, dev, contiguous=True)  # fmt: skip
            self.num_rope_positions = self.cos_sin_cache.shape[0]
        if compressed_cache is not None:
            self.compressed_cache = _check(compressed_cache, "compressed_cache",
                                           (None, None, self.entry_bytes), (torch.uint8,), dev,
                                           contiguous=True)  # fmt: skip
            self.compressed_capacity = compressed_cache.shape[0] * compressed_cache.shape[1]
        if not (isinstance(eps, float | int) and eps > 0):
            raise _fail("eps", "a float > 0", eps)
        self.eps = float(eps)
        self._write = shared_launcher(_state_write_kernel, direct_launch)
        self._compress = shared_launcher(_compress_kernel, direct_launch)

    def check_write(self, kv: object, score: object, positions: object, state_slot_mapping: object) -> int:  # fmt: skip
        """Validate the step tensors of :func:`c128_state_write`; return ``T``.

        Raises:
            GeometryError: a tensor has the wrong type, shape, dtype, device or layout.
        """
        dev, num_tokens = self.device, _num_tokens(positions)
        if not (
            _is_index(positions, num_tokens, dev)
            and _is_index(state_slot_mapping, num_tokens, dev)
            and _is_rows(kv, num_tokens, self.head_dim, _FLOAT, dev)
            and _is_rows(score, num_tokens, self.head_dim, (kv.dtype,), dev)
        ):
            self._tokens(positions, state_slot_mapping=state_slot_mapping)
            kv = _check(kv, "kv", (num_tokens, self.head_dim), _FLOAT, dev)
            _check(score, "score", (num_tokens, self.head_dim), (kv.dtype,), dev)
        return num_tokens

    def check_compress(self, state_block_table: object, req_indices: object, positions: object, compressed_slot_mapping: object) -> int:  # fmt: skip
        """Validate the step tensors of :func:`c128_compress`; return ``T``.

        Raises:
            GeometryError: a tensor has the wrong type, shape, dtype, device or layout.
        """
        dev, num_tokens = self.device, _num_tokens(positions)
        table = state_block_table
        if not (
            isinstance(table, torch.Tensor)
            and table.dim() == 2
            and table.dtype in _INDEX
            and table.device == dev
            and (table.numel() == 0 or table.stride(1) == 1)
            and _is_index(positions, num_tokens, dev)
            and _is_index(req_indices, num_tokens, dev)
            and _is_index(compressed_slot_mapping, num_tokens, dev)
        ):
            _check(table, "state_block_table", (None, None), _INDEX, dev)
            self._tokens(positions, req_indices=req_indices,
                         compressed_slot_mapping=compressed_slot_mapping)  # fmt: skip
        return num_tokens

    def _tokens(self, positions: object, **index_tensors: object) -> None:
        """Slow path: raise for the first malformed ``[T]`` index tensor."""
        num_tokens = _check(positions, "positions", (None,), _INDEX, self.device).shape[0]
        for name, t in index_tensors.items():
            _check(t, name, (num_tokens,), _INDEX, self.device)

    def check_write_bounds(self, positions: torch.Tensor, state_slot_mapping: torch.Tensor) -> None:  # fmt: skip
        """Opt-in: raise for what the state write would skip (one device->host sync).

        Raises:
            ConfigError: called under CUDA-graph capture.
            InvalidBlockError: a real slot (>= 0) is >= ``num_state_blocks * S``, or a position
                of a real slot is negative.
        """
        _refuse_under_capture(positions)
        if positions.numel() == 0:
            return
        slots = state_slot_mapping.long()
        real = slots >= 0
        worst = torch.stack([torch.where(real, slots, -1).max(),
                             torch.where(real, positions.long(), 0).min()]).tolist()  # fmt: skip
        if worst[0] >= self.state_capacity:
            raise InvalidBlockError(
                f"state_slot_mapping: expected slots < {self.state_capacity} (num_state_blocks "
                f"{self.num_state_blocks} x S {self.block_size}), got {worst[0]}"
            )
        if worst[1] < 0:
            raise InvalidBlockError(f"positions: expected values >= 0, got {worst[1]}")

    def check_compress_bounds(self, state_block_table: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor, compressed_slot_mapping: torch.Tensor) -> None:  # fmt: skip
        """Opt-in: raise for a boundary token the compress kernel would skip (one sync).

        Only tokens with a boundary position and a slot >= 0 are checked: their slot, table
        row, the width and entries of that row over the token's window, and the RoPE row.

        Raises:
            ConfigError: called under CUDA-graph capture.
            InvalidBlockError: one of those lies outside the tensor it indexes.
        """
        _refuse_under_capture(positions)
        pos, slots = positions.long(), compressed_slot_mapping.long()
        todo = ((pos + 1) % C128_RATIO == 0) & (slots >= 0)
        if positions.numel() == 0 or not bool(todo.any()):
            return
        pos, slots, reqs = pos[todo], slots[todo], req_indices.long()[todo]
        num_reqs, width = state_block_table.shape
        facts = [
            ("compressed_slot_mapping", f"slots < {self.compressed_capacity}", slots.max()),
            ("positions at a boundary", f"values >= {C128_RATIO - 1}", pos.min()),
            ("req_indices", f"rows of the table in [0, {num_reqs})", reqs.min()),
            ("req_indices", f"rows of the table in [0, {num_reqs})", reqs.max()),
            ("positions // S", f"block indices < the table width {width}",
             pos.max() // self.block_size),
            ("(positions // 128) * 128", f"rows of cos_sin_cache < {self.num_rope_positions}",
             (pos.max() // C128_RATIO) * C128_RATIO),
        ]  # fmt: skip
        got = torch.stack([f[2] for f in facts]).tolist()
        bad = [got[0] >= self.compressed_capacity, got[1] < C128_RATIO - 1, got[2] < 0,
               got[3] >= num_reqs, got[4] >= width, got[5] >= self.num_rope_positions]  # fmt: skip
        for (name, want, _), value, is_bad in zip(facts, got, bad, strict=True):
            if is_bad:
                raise InvalidBlockError(f"{name}: expected {want}, got {value}")
        window = pos[:, None] - (C128_RATIO - 1) + torch.arange(C128_RATIO, device=pos.device)
        blocks = state_block_table.long()[reqs[:, None], window // self.block_size]
        low, high = torch.stack([blocks.min(), blocks.max()]).tolist()
        if low < 0 or high >= self.num_state_blocks:
            raise InvalidBlockError(
                f"state_block_table entries of boundary windows: expected blocks in [0, "
                f"{self.num_state_blocks}), got {low if low < 0 else high}"
            )

    def launch_write(self, num_tokens: int, kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor, state_slot_mapping: torch.Tensor) -> None:  # fmt: skip
        """Enqueue the state write of ``num_tokens`` checked tokens on the current stream."""
        if num_tokens:
            self._write(
                (num_tokens,), kv, score, self.ape, positions, state_slot_mapping, self.state_cache,
                kv.stride(0), score.stride(0), *self.state_strides, self.state_capacity,
                self.block_size, self.head_dim, C128_RATIO,
            )  # fmt: skip

    def launch_compress(self, num_tokens: int, state_block_table: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor, compressed_slot_mapping: torch.Tensor) -> None:  # fmt: skip
        """Enqueue the compression of ``num_tokens`` checked candidate tokens."""
        if num_tokens:
            self._compress(
                (num_tokens,), self.state_cache, state_block_table, req_indices, positions,
                compressed_slot_mapping, self.norm_weight, self.cos_sin_cache,
                self.compressed_cache, *self.state_strides, state_block_table.stride(0), self.eps,
                state_block_table.shape[0], state_block_table.shape[1], self.num_state_blocks,
                self.num_rope_positions, self.compressed_capacity, self.block_size, self.head_dim, C128_ROPE_DIM, C128_RATIO, _WINDOW_CHUNK,
                self.entry_bytes, num_warps=4,
            )  # fmt: skip


def _refuse_under_capture(t: torch.Tensor) -> None:
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ConfigError("check_slots: expected False under CUDA-graph capture, got True")


def _num_tokens(positions: object) -> int:
    """``T`` from a 1-D ``positions`` tensor; -1 (fails every check) for anything else."""
    if isinstance(positions, torch.Tensor) and positions.dim() == 1:
        return positions.size(0)
    return -1


def c128_state_write(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    state_slot_mapping: torch.Tensor,
    state_cache: torch.Tensor,
    *,
    check_slots: bool = False,
    direct_launch: bool = True,
) -> None:
    """Write every token's state row ``[kv | score + ape[pos % 128]]`` (fp32) into the cache.

    Args:
        kv: ``[T, D]`` fp32/bf16/fp16, unit last stride (rows may be strided).
        score: ``[T, D]``, same dtype as ``kv``, unit last stride.
        ape: ``[128, D]`` fp32 contiguous, the learned position bias.
        positions: ``[T]`` int32/int64, absolute position of each token (>= 0).
        state_slot_mapping: ``[T]`` int32/int64; slot ``s`` is block ``s // S``, row ``s % S``;
            ``s < 0`` marks padding, which writes nothing; so does ``s >= num_state_blocks * S``
            (and a negative position).
        state_cache: ``[num_state_blocks, S, 2D]`` fp32, unit last stride; mutated in place.
        check_slots: raise for slots past the cache and negative positions instead of skipping
            them (one reduction and one device->host sync; refused under graph capture).
        direct_launch: launch the compiled kernel directly (:mod:`kvmgr.kernels._launch`);
            ``False`` takes Triton's normal launch.

    Raises:
        GeometryError: a tensor has the wrong type, shape, dtype, device or layout.
        InvalidBlockError: ``check_slots`` and a slot or position is out of range.
        ConfigError: ``check_slots`` under CUDA-graph capture.
        ImportError: Triton is not installed.
    """
    layer = _Layer(state_cache, ape=ape, direct_launch=direct_launch)
    num_tokens = layer.check_write(kv, score, positions, state_slot_mapping)
    if check_slots:
        layer.check_write_bounds(positions, state_slot_mapping)
    layer.launch_write(num_tokens, kv, score, positions, state_slot_mapping)


def c128_compress(
    state_cache: torch.Tensor,
    state_block_table: torch.Tensor,
    req_indices: torch.Tensor,
    positions: torch.Tensor,
    compressed_slot_mapping: torch.Tensor,
    norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    compressed_cache: torch.Tensor,
    *,
    eps: float = 1e-6,
    check_slots: bool = False,
    direct_launch: bool = True,
) -> None:
    """Compress the 128-row window of every boundary token into its compressed slot.

    Tokens whose position is not a boundary (``(pos + 1) % 128 != 0``) or whose compressed slot
    is negative write nothing, so one launch over all tokens of a step is correct. Boundary
    tokens whose slot, table row, window blocks or RoPE row fall outside the given tensors write
    nothing either (never read or write out of bounds; ``check_slots`` raises instead).

    Args:
        state_cache: ``[num_state_blocks, S, 2D]`` fp32, filled by :func:`c128_state_write`
            for every position of each boundary token's window.
        state_block_table: ``[num_reqs, max_state_blocks]`` int32/int64, unit last stride; entry
            ``[r, p // S]`` is the state block holding position ``p`` of request ``r``.
        req_indices: ``[T]`` int32/int64, each token's row of ``state_block_table``.
        positions: ``[T]`` int32/int64, absolute positions (>= 0).
        compressed_slot_mapping: ``[T]`` int32/int64; ``s < 0`` skips the token.
        norm_weight: ``[D]`` fp32/bf16/fp16 RMSNorm weight, contiguous.
        cos_sin_cache: ``[max_positions, 64]`` fp32, contiguous: 32 cos then 32 sin per
            position; a boundary token whose ``(pos // 128) * 128`` is past its rows is skipped.
        compressed_cache: ``[num_blocks, block_size, D + 64 + D // 64]`` uint8 contiguous;
            mutated in place at boundary slots only (layout in the module docstring).
        eps: RMSNorm epsilon (> 0).
        check_slots: raise :class:`~kvmgr.errors.InvalidBlockError` for a boundary token that
            the device would skip as out of range (one device->host sync; not under capture).
        direct_launch: as in :func:`c128_state_write`.

    Raises:
        GeometryError: a tensor has the wrong type, shape, dtype, device or layout, or
            ``eps <= 0``.
        InvalidBlockError: ``check_slots`` and a boundary token indexes out of range.
        ConfigError: ``check_slots`` under CUDA-graph capture.
        ImportError: Triton is not installed.
    """
    layer = _Layer(state_cache, norm_weight=norm_weight, cos_sin_cache=cos_sin_cache,
                   compressed_cache=compressed_cache, eps=eps, direct_launch=direct_launch)  # fmt: skip
    args = (state_block_table, req_indices, positions, compressed_slot_mapping)
    num_tokens = layer.check_compress(*args)
    if check_slots:
        layer.check_compress_bounds(*args)
    layer.launch_compress(num_tokens, *args)
