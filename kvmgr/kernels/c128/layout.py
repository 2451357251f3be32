"""Constants and the entry layout of the DeepSeek-V4 c128 compressor (no torch, no Triton).

Offers:
    C128_RATIO         tokens per compressed entry (128)
    C128_ROPE_DIM      RoPE dims at the end of each entry (64)
    GROUP              dims per FP8 scale group (64)
    c128_entry_bytes   bytes of one compressed entry (584 for head dim 512)

The byte layout of an entry is documented in :mod:`kvmgr.kernels.c128.api`.
"""

from __future__ import annotations

from kvmgr.errors import GeometryError

__all__ = ["C128_RATIO", "C128_ROPE_DIM", "GROUP", "c128_entry_bytes"]

C128_RATIO = 128
C128_ROPE_DIM = 64
GROUP = 64  # dims per FP8 scale group (the kernel spells out 64, 448 and the 1e-4 floor)


def c128_entry_bytes(head_dim: int = 512) -> int:
    """Bytes of one compressed entry: ``head_dim + 64 + head_dim // 64`` (584 for 512).

    Raises:
        GeometryError: ``head_dim`` is not a power of two >= 128.
    """
    if head_dim < 128 or head_dim & (head_dim - 1):
        raise GeometryError(f"head_dim: expected a power of two >= 128, got {head_dim}")
    return head_dim + C128_ROPE_DIM + head_dim // GROUP
