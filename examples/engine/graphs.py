"""Decode steps in CUDA graphs: fixed shapes per batch-size bucket, replayed every decode step.

Offers:
    DecodeGraphs    ``run(batch)`` for a decode-only ``StepBatch``: pads it to a bucket, copies
                    it into the bucket's static inputs, replays the bucket's graph (or, without
                    CUDA graphs, runs the same static-shape code eagerly)

Why: the eager decode of ``model.py`` launches ~30 kernels per layer from Python and gathers each
request's context into a tensor sized to the step's longest context, so on a GPU a decode step is
host-bound and the end-to-end run measures the example's overhead, not offload (issue 24). Here
every shape is fixed per bucket: ``B`` requests (padded with rows that write a scratch slot and
are dropped), a block table of ``max_blocks`` columns (padding masked out on the device from the
context lengths, ``positions + 1``), the KV heads read as is (``enable_gqa``: no repeat).

The math is ``model.py``'s (RMSNorm, RoPE, SwiGLU, attention over the paged cache); it reads
and writes the same KV tensors, so a request may decode in a graph one step and eagerly the next.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from examples.engine.model import PagedDecoder, StepBatch, _rotate_half

__all__ = ["DecodeGraphs"]

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class DecodeGraphs:
    """Static-shape decode for ``model`` over ``kv_caches`` (``[k_0, v_0, ...]``).

    Args:
        model: the decoder.
        kv_caches: its paged KV tensors.
        max_blocks: block-table columns of every bucket (a request with more blocks decodes
            eagerly).
        pad_slot: a cache slot nobody reads (a block the engine holds for this), written by
            padding rows.
        capture: capture CUDA graphs (CUDA tensors only); ``False`` runs the static code eagerly.
        max_batch: largest bucket.
    """

    def __init__(
        self,
        model: PagedDecoder,
        kv_caches: list[torch.Tensor],
        *,
        max_blocks: int,
        pad_slot: int,
        capture: bool,
        max_batch: int = 64,
    ) -> None:
        self.model, self.kv = model, kv_caches
        self.max_blocks, self.pad_slot = max_blocks, pad_slot
        self.device = kv_caches[0].device
        self.capture = capture and self.device.type == "cuda"
        self.buckets = [b for b in BUCKETS if b <= max_batch]
        self._static: dict[int, dict[str, torch.Tensor]] = {}
        self._graphs: dict[int, Any] = {}
        self._pool: Any = None
        self.replays = 0

    def fits(self, b: StepBatch) -> bool:
        """Whether ``b`` is decode-only and fits a bucket."""
        num = len(b.context_lens)
        return (
            num > 0
            and b.num_decodes == num
            and num <= self.buckets[-1]
            and b.block_tables.shape[1] <= self.max_blocks
        )

    def run(self, b: StepBatch) -> torch.Tensor:
        """float32 logits ``[R, vocab]`` of a decode-only batch (``fits(b)``), one row per
        request (``b.sample_rows`` must be every row, in order)."""
        num = len(b.context_lens)
        bucket = next(x for x in self.buckets if x >= num)
        inputs = self._static.get(bucket) or self._inputs(bucket)
        inputs["input_ids"][:num].copy_(b.input_ids)
        inputs["positions"][:num].copy_(b.positions)
        inputs["slots"][:num].copy_(b.slot_mapping)
        inputs["tables"][:num].zero_()
        inputs["tables"][:num, : b.block_tables.shape[1]].copy_(b.block_tables)
        if num < bucket:  # padding rows: position 0 (one valid slot), the scratch slot
            inputs["positions"][num:].zero_()
            inputs["slots"][num:].fill_(self.pad_slot)
            inputs["tables"][num:].fill_(self.pad_slot // self.kv[0].shape[1])
        if not self.capture:
            return self._forward(inputs)[:num].clone()
        graph = self._graphs.get(bucket)
        if graph is None:
            graph = self._graphs[bucket] = self._capture(inputs)
        graph.replay()
        self.replays += 1
        return inputs["logits"][:num].clone()

    def _inputs(self, bucket: int) -> dict[str, torch.Tensor]:
        dev, i64 = self.device, torch.int64
        inputs = {
            "input_ids": torch.zeros(bucket, dtype=i64, device=dev),
            "positions": torch.zeros(bucket, dtype=i64, device=dev),
            "slots": torch.full((bucket,), self.pad_slot, dtype=i64, device=dev),
            "tables": torch.zeros(bucket, self.max_blocks, dtype=i64, device=dev),
        }
        self._static[bucket] = inputs
        return inputs

    def _capture(self, inputs: dict[str, torch.Tensor]) -> Any:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside the capture (allocator, cuBLAS handles)
            for _ in range(2):
                self._forward(inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread-local: kvmgr's completion threads synchronize events while this thread captures
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            inputs["logits"] = self._forward(inputs)
        return graph

    @torch.inference_mode()
    def _forward(self, s: dict[str, torch.Tensor]) -> torch.Tensor:
        m, c = self.model, self.model.config
        x = m.model.embed_tokens(s["input_ids"])
        freqs = s["positions"][:, None].float() * m.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        block_size = self.kv[0].shape[1]
        context = self.max_blocks * block_size
        valid = torch.arange(context, device=self.device) < (s["positions"] + 1)[:, None]
        mask = valid[:, None, None, :]  # [B, 1, 1, L]
        n = x.shape[0]
        for i, layer in enumerate(m.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(n, c.num_heads, c.head_dim)
            k = attn.k_proj(h).view(n, c.num_kv_heads, c.head_dim)
            v = attn.v_proj(h).view(n, c.num_kv_heads, c.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache, v_cache = self.kv[2 * i], self.kv[2 * i + 1]
            k_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, s["slots"], k)
            v_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, s["slots"], v)
            keys = self._context(k_cache, s["tables"], valid)
            vals = self._context(v_cache, s["tables"], valid)
            o = F.scaled_dot_product_attention(
                q[:, :, None, :], keys, vals, attn_mask=mask, enable_gqa=True
            )
            x = x + attn.o_proj(o.reshape(n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.lm_head(m.model.norm(x)).float()

    @staticmethod
    def _context(cache: torch.Tensor, tables: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``[B, kv_heads, L, head_dim]`` of the table's blocks, slots past a request's length
        zeroed (they may hold NaN: ``0 * NaN`` must not leak through the mask)."""
        b, nb = tables.shape
        flat = cache[tables].reshape(b, nb * cache.shape[1], cache.shape[2], cache.shape[3])
        flat = flat.masked_fill(~valid[:, :, None, None], 0.0)
        return flat.transpose(1, 2)
