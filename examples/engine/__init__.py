"""A small paged-attention serving loop over a Hugging Face Llama/Qwen2 model, with kvmgr's CPU tier.

Offers:
    model.PagedDecoder   the transformer (HF weights, our paged attention)
    engine.Engine        continuous batching, chunked prefill, prefix reuse and preemption via kvmgr
    bench                ``python -m examples.engine.bench``: the end-to-end benchmark

See examples/engine/README.md for how a loop embeds kvmgr.
"""
