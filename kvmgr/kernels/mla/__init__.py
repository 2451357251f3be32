"""The MLA cache insert: one Triton launch writes a step's latent KV into every layer's cache.

Modules (dependencies one-way, each only on those listed before it):
    kernel      the Triton kernels
    checks      input checks (torch only)
    reference   the torch reference (``mla_insert_reference``)
    plan        checked caches and their pointer table (``Plan``), launch constants, the
                per-layer launches
    insert      ``GroupedInsert``: one plan's launches, checks cached per step signature
    memo        ``InsertMemo``: the public function's cache sets (the one owner of their plans)
    api         ``grouped_mla_insert``, ``per_layer_mla_insert`` (public)
    hook        ``GroupedMLAInsertHook`` (imports Triton only when constructed; owns its insert)

Importing this package imports none of them.
"""
