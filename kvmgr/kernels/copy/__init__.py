"""The SM copy kernels of the transfer engines (``engine="kernel"`` / ``"auto"``).

Modules (dependencies one-way, each only on those listed before it):
    row         ``copy_row``: one row at the widest vector width; program caps, chunk size
    tables      the kernels' tables, built and checked on the host (numpy only)
    pages       the descriptor kernel: one ``(src, dst, bytes)`` row per page or slice
    blocks      the paged kernel: block runs, page addresses computed on the device
    staging     the engines' staging: tables in pooled pinned slots, one upload, one packed
                launch on the copy stream (``CopyStager``, used by ``kvmgr.transfer.kernel``)

Importing this package imports none of them. docs/copy-kernel.md describes both kernels, the staging and their figures.
"""
