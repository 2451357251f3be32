"""kvmgr inside vLLM 0.33's KV offloading stack (``vllm/v1/kv_offload``).

Offers (each module imports vLLM; install with ``pip install 'kvmgr[vllm]'``, see
docs/guides/vllm.md):

    policies    kvmgr's eviction policies as vLLM ``CachePolicy`` classes, loaded by vLLM
                through ``eviction_policy`` + ``cache_policy_module_path``
    tiers       kvmgr's ``DiskTier`` and ``SharedTier`` (Valkey/Redis) as vLLM
                ``SecondaryTierManager`` classes, loaded through ``secondary_tiers``
                (``type`` + ``module_path``) of ``TieringOffloadingSpec``
    backend     kvmgr's whole offloading backend: ``KvmgrOffloadingSpec`` (its scheduler-side
                manager and per-rank transfer worker), loaded through ``spec_name`` +
                ``spec_module_path``; ``KvmgrOffloadingConnector`` (failed loads reported to
                vLLM as load errors)

This package is imported by vLLM's factories, never by the rest of kvmgr.
"""
