"""Model-specific cache layouts on top of the manager; importing this package imports none.

Packages:
    deepseek_v4   DeepSeek-V4's cache groups (compressed c4/c128 + indexer, sliding window,
                  compressor states), the live blocks at a boundary, and a bit-exact offload
                  and restore of a request through ``OffloadManager``s
"""
