"""The MLA cache insert: one Triton launch writes a step's latent KV into every layer's cache.

Modules (dependencies one-way, each only on those listed before it):
    kernel      the Triton kernels
    checks      input checks (torch only)
    reference   the torch reference (``mla_insert_reference``)
    host        plans, pointer tables, constexprs, launches
    api         ``grouped_mla_insert``, ``per_layer_mla_insert`` (public)
    hook        ``GroupedMLAInsertHook`` (imports Triton only when constructed)

Importing this package imports none of them.
"""
