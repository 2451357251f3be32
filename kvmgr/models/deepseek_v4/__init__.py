"""DeepSeek-V4: its caches as cache groups, and a bit-exact offload and restore at any boundary.

Modules (dependencies one-way):
    layout    ``DeepSeekV4Layout`` (presets ``flash()``, ``pro()``), ``CacheGroup``,
              ``TensorSpec``: the geometry and the live positions at a boundary (no torch)
    offload   ``DeepSeekV4Offload``, ``allocate_caches``, ``boundary_keys``: one request's live
              blocks through one ``OffloadManager`` per group

The torch references of the cache writers kvmgr has no kernel for (the c4 and indexer
compressors, the sliding-window insert) are in :mod:`kvmgr.kernels.c128.v4_reference`; the c128
compressor is :class:`kvmgr.C128CompressorHook`. The guide is docs/hybrid-models.md.
"""

from __future__ import annotations

from kvmgr.models.deepseek_v4.layout import GROUP_NAMES, CacheGroup, DeepSeekV4Layout, TensorSpec
from kvmgr.models.deepseek_v4.offload import DeepSeekV4Offload, allocate_caches, boundary_keys

__all__ = [
    "GROUP_NAMES",
    "CacheGroup",
    "DeepSeekV4Layout",
    "DeepSeekV4Offload",
    "TensorSpec",
    "allocate_caches",
    "boundary_keys",
]
