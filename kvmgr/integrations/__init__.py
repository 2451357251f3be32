"""Adapters that plug kvmgr into other serving engines.

Offers:
    vllm   kvmgr's eviction policies and lower tiers inside vLLM 0.33's offloading stack
           (``kvmgr.integrations.vllm``; needs the ``vllm`` extra, see docs/guides/vllm.md)

Nothing here is imported by the rest of kvmgr: each adapter sits on top of the public API.
"""
