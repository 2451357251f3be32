"""DeepSeek-V4's caches as cache groups: geometry, presets, and what a boundary needs (no torch).

Offers:
    DeepSeekV4Layout   per-layer compress ratios and cache geometry; ``flash()`` and ``pro()``
    CacheGroup         one group of tensors sharing a block table: name, kind, tokens per block
    TensorSpec         one tensor of a group: name, per-block shape, dtype
    GROUP_NAMES        ``("compressed", "swa", "c4_state", "c128_state")``

Every layer keeps a sliding-window (SWA) cache of its uncompressed KV; a layer of compress ratio
4 (CSA) adds a c4 compressed cache, an indexer key cache and two compressor states (its own and
the indexer's, overlapping 8-token windows); a layer of ratio 128 (HCA) adds a c128 compressed
cache and its compressor state; ratio 0 is SWA only. The tensors fall into four groups, each
paged by its own block table (the geometry vLLM uses for DeepSeek-V4):

================  =======  =========================================================  ============
group             tokens   tensors (per-block shape, dtype)                            live at N
================  =======  =========================================================  ============
``compressed``    256      c4 ``[64, 584]`` u8 + indexer ``[64, 132]`` u8 per c4      ``[0, N)``
                           layer; c128 ``[2, 584]`` u8 per c128 layer
``swa``           64       ``[64, 584]`` u8 per layer                                  ``[N-W+1, N)``
``c4_state``      4        ``[4, 4D]`` f32 + indexer ``[4, 4Di]`` f32 per c4 layer    ``[4(N//4)-4, N)``
``c128_state``    8        ``[8, 2D]`` f32 per c128 layer                              ``[128(N//128), N)``
================  =======  =========================================================  ============

*Live at N* is what a request that has computed ``N`` tokens will still read: attention reads
all compressed entries, the SWA of the last ``W - 1`` tokens (vLLM's sliding-window rule), the
c4 states from the window start of the next ratio-4 boundary (``4(N//4) + 3 - 7``) and the c128
states of the unfinished 128-token window. Everything older may be dropped, and a restore at
``N`` loads exactly the blocks that hold live positions (:meth:`DeepSeekV4Layout.blocks_at`).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs

from kvmgr.errors import ConfigError, InvalidArgumentError
from kvmgr.kernels.c128.layout import C128_RATIO, C128_ROPE_DIM, c128_entry_bytes

__all__ = ["GROUP_NAMES", "CacheGroup", "DeepSeekV4Layout", "TensorSpec"]

GROUP_NAMES = ("compressed", "swa", "c4_state", "c128_state")
_RATIOS = (0, 4, 128)
_DTYPE_BYTES = {"uint8": 1, "float32": 4}


@attrs.frozen
class TensorSpec:
    """One tensor of a cache group.

    Attributes:
        name: ``"L{layer}.{kind}"``, for example ``"L3.c128"`` or ``"L2.indexer_state"``.
        block_shape: shape of one block (the tensor is ``[num_blocks, *block_shape]``).
        dtype: ``"uint8"`` or ``"float32"``.
    """

    name: str
    block_shape: tuple[int, ...]
    dtype: str

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of this tensor."""
        size = _DTYPE_BYTES[self.dtype]
        for n in self.block_shape:
            size *= n
        return size


@attrs.frozen
class CacheGroup:
    """Tensors that share one block table (one block id per ``block_size`` tokens).

    Attributes:
        name: one of :data:`GROUP_NAMES`.
        kind: ``"prefix"`` (content-addressed, every block up to the boundary is live) or
            ``"window"`` (request-local, only the blocks of the live window).
        block_size: tokens per block.
        tensors: the group's tensors, in layer order.
    """

    name: str
    kind: str
    block_size: int
    tensors: tuple[TensorSpec, ...]

    @property
    def page_bytes(self) -> int:
        """Bytes of one block in all of the group's tensors together."""
        return sum(t.page_bytes for t in self.tensors)


def _alternating(first: int, end: int) -> tuple[int, ...]:
    """Ratio 4 on even and 128 on odd layers ``first .. end - 1``."""
    return tuple(4 if i % 2 == 0 else C128_RATIO for i in range(first, end))


def _positive(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{attribute.name}: expected an int >= 1, got {value!r}")


def _power_of_two(minimum: int) -> Any:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        _positive(instance, attribute, value)
        if value < minimum or value & (value - 1):
            raise ConfigError(
                f"{attribute.name}: expected a power of two >= {minimum}, got {value}"
            )

    return check


def _ratios(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, tuple) or not value or any(r not in _RATIOS for r in value):
        raise ConfigError(
            f"compress_ratios: expected a non-empty tuple of 0, 4 or 128, got {value!r}"
        )


def _block_size(instance: Any, attribute: Any, value: Any) -> None:
    _positive(instance, attribute, value)
    if value % C128_RATIO:
        raise ConfigError(f"block_size: expected a multiple of {C128_RATIO} tokens, got {value}")


@attrs.frozen(kw_only=True)
class DeepSeekV4Layout:
    """Geometry of a DeepSeek-V4 model's caches (see the module docstring for the groups).

    Attributes:
        compress_ratios: per layer, 0 (SWA only), 4 (CSA: c4 + indexer) or 128 (HCA), as the
            model config's ``compress_ratios``.
        head_dim: ``D``, the attention head dim (512); entries take ``c128_entry_bytes(D)``.
        index_head_dim: ``Di``, the indexer head dim (128); entries take ``Di + 4`` bytes.
        window: ``W``, the sliding window in tokens (128).
        block_size: tokens per block of the compressed group (a multiple of 128; 256).
        swa_block_size: tokens per SWA block (64).
        c4_state_block_size: positions per c4 / indexer state block (4).
        c128_state_block_size: positions per c128 state block (8).

    Raises:
        ConfigError: a field is out of range.
    """

    compress_ratios: tuple[int, ...] = attrs.field(converter=tuple, validator=_ratios)
    head_dim: int = attrs.field(default=512, validator=_power_of_two(128))
    index_head_dim: int = attrs.field(default=128, validator=_power_of_two(C128_ROPE_DIM))
    window: int = attrs.field(default=128, validator=_positive)
    block_size: int = attrs.field(default=256, validator=_block_size)
    swa_block_size: int = attrs.field(default=64, validator=_positive)
    c4_state_block_size: int = attrs.field(default=4, validator=_positive)
    c128_state_block_size: int = attrs.field(default=8, validator=_positive)

    @classmethod
    def flash(cls, **overrides: Any) -> DeepSeekV4Layout:
        """DeepSeek-V4-Flash: 43 layers; 0 and 1 SWA only, then ratio 4 on even and 128 on odd
        layers (21 CSA, 20 HCA), as its published config describes."""
        return cls(compress_ratios=(0, 0, *_alternating(2, 43)), **overrides)

    @classmethod
    def pro(cls, **overrides: Any) -> DeepSeekV4Layout:
        """DeepSeek-V4-Pro: 61 layers; 0 and 1 ratio 128, then 4 on even and 128 on odd layers
        (30 CSA, 31 HCA), as its published config describes."""
        return cls(compress_ratios=(128, 128, *_alternating(2, 61)), **overrides)

    def layers(self, ratio: int) -> tuple[int, ...]:
        """Indices of the layers of one compress ratio (0, 4 or 128)."""
        return tuple(i for i, r in enumerate(self.compress_ratios) if r == ratio)

    @property
    def entry_bytes(self) -> int:
        """Bytes of one c4, c128 or SWA entry (584 for ``D = 512``)."""
        return c128_entry_bytes(self.head_dim)

    @property
    def index_entry_bytes(self) -> int:
        """Bytes of one indexer entry (132 for ``Di = 128``)."""
        return self.index_head_dim + 4

    @functools.cached_property
    def groups(self) -> tuple[CacheGroup, ...]:
        """The non-empty cache groups, in :data:`GROUP_NAMES` order (computed once)."""
        e, b, d, di = self.entry_bytes, self.block_size, self.head_dim, self.index_head_dim
        compressed: list[TensorSpec] = []
        c4_state: list[TensorSpec] = []
        c128_state: list[TensorSpec] = []
        for i, r in enumerate(self.compress_ratios):
            if r == 4:
                compressed += [TensorSpec(f"L{i}.c4", (b // 4, e), "uint8"),
                               TensorSpec(f"L{i}.indexer", (b // 4, self.index_entry_bytes), "uint8")]  # fmt: skip
                s = self.c4_state_block_size
                c4_state += [TensorSpec(f"L{i}.c4_state", (s, 4 * d), "float32"),
                             TensorSpec(f"L{i}.indexer_state", (s, 4 * di), "float32")]  # fmt: skip
            elif r == 128:
                compressed.append(TensorSpec(f"L{i}.c128", (b // C128_RATIO, e), "uint8"))
                c128_state.append(TensorSpec(f"L{i}.c128_state", (self.c128_state_block_size, 2 * d), "float32"))  # fmt: skip
        swa = [TensorSpec(f"L{i}.swa", (self.swa_block_size, e), "uint8")
               for i in range(len(self.compress_ratios))]  # fmt: skip
        groups = (
            CacheGroup("compressed", "prefix", b, tuple(compressed)),
            CacheGroup("swa", "window", self.swa_block_size, tuple(swa)),
            CacheGroup("c4_state", "window", self.c4_state_block_size, tuple(c4_state)),
            CacheGroup("c128_state", "window", self.c128_state_block_size, tuple(c128_state)),
        )
        return tuple(g for g in groups if g.tensors)

    def group(self, name: str) -> CacheGroup:
        """The group called ``name``.

        Raises:
            InvalidArgumentError: no such group in this layout.
        """
        for g in self.groups:
            if g.name == name:
                return g
        names = [g.name for g in self.groups]
        raise InvalidArgumentError(f"group: expected one of {names}, got {name!r}")

    def live_start(self, name: str, num_tokens: int) -> int:
        """First position of group ``name`` that a request of ``num_tokens`` tokens still reads.

        Positions ``[live_start, num_tokens)`` are live (the table in the module docstring);
        ``live_start == num_tokens`` means the group needs nothing at this boundary.

        Raises:
            InvalidArgumentError: ``num_tokens`` is not an int >= 0, or no such group.
        """
        self.group(name)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens: expected an int >= 0, got {num_tokens!r}")
        n = num_tokens
        start = {
            "compressed": 0,
            "swa": n - self.window + 1,
            "c4_state": 4 * (n // 4) - 4,
            "c128_state": C128_RATIO * (n // C128_RATIO),
        }[name]
        return min(max(start, 0), n)

    def blocks_at(self, name: str, num_tokens: int) -> range:
        """Logical blocks of group ``name`` that hold its live positions at ``num_tokens``.

        Raises:
            InvalidArgumentError: as :meth:`live_start`.
        """
        start, size = self.live_start(name, num_tokens), self.group(name).block_size
        if start == num_tokens:
            return range(0)
        return range(start // size, -(-num_tokens // size))

    def blocks_for(self, name: str, first: int, end: int) -> range:
        """Logical blocks of group ``name`` covering positions ``[first, end)`` (for allocation)."""
        size = self.group(name).block_size
        return range(first // size, -(-end // size)) if end > first else range(0)
