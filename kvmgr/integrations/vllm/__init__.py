"""kvmgr inside vLLM 0.33's KV offloading stack (``vllm/v1/kv_offload``).

Offers (each module imports vLLM; install with ``pip install 'kvmgr[vllm]'``, see
docs/guides/vllm.md):

    policies    kvmgr's eviction policies as vLLM ``CachePolicy`` classes, loaded by vLLM
                through ``eviction_policy`` + ``cache_policy_module_path``
    tiers       kvmgr's ``DiskTier`` and ``SharedTier`` (Valkey/Redis) as vLLM
                ``SecondaryTierManager`` classes, loaded through ``secondary_tiers``
                (``type`` + ``module_path``) of ``TieringOffloadingSpec``

This package is imported by vLLM's factories, never by the rest of kvmgr.
"""
