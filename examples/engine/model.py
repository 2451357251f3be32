"""A decoder-only transformer (Llama / Qwen2 family) whose attention reads a paged KV cache.

Offers:
    ModelConfig     the shapes, read from a Hugging Face config or given by hand (``LLAMA3_8B``)
    StepBatch       one step's flattened tokens and attention metadata (built by the engine)
    PagedDecoder    the model: ``from_hf(model)`` copies HF weights, ``random(config, seed)``
    new_kv_caches   the per-layer K and V tensors in kvmgr's layout

Embeddings, RMSNorm, rotary embedding, SwiGLU MLP and the projections port the math of
``transformers.models.llama.modeling_llama`` (module names match, so an HF ``state_dict`` loads
as is); only the attention is ours. KV layout, one K and one V tensor per layer (these are the
tensors handed to ``kvmgr.OffloadManager``, dim 0 = blocks)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

A token at slot ``s`` lives at ``cache.view(-1, num_kv_heads, head_dim)[s]``, with
``s = block_id * block_size + offset``. New K/V are written by slot mapping, then read back
through the block tables (gather + ``scaled_dot_product_attention``; GQA by repeating KV heads).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LLAMA3_8B", "ModelConfig", "PagedDecoder", "StepBatch", "new_kv_caches"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Transformer shapes. ``rope_theta`` is the base of the default RoPE (no scaling)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, config: Any) -> ModelConfig:
        """Read a ``LlamaConfig`` / ``Qwen2Config`` (transformers >= 4.45).

        Raises:
            ValueError: a RoPE scaling, sliding window or MLP bias this port does not implement.
        """
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        scaling = getattr(config, "rope_scaling", None)
        if rope_type != "default" or (scaling and scaling.get("rope_type", "default") != "default"):
            raise ValueError(f"only the default RoPE is ported, got {rope_type!r} / {scaling!r}")
        if getattr(config, "use_sliding_window", False) or getattr(config, "mlp_bias", False):
            raise ValueError("sliding-window attention and MLP bias are not ported")
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=config.num_key_value_heads or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            rms_norm_eps=config.rms_norm_eps,
            # Llama says attention_bias; Qwen2 always has q/k/v biases
            qkv_bias=bool(getattr(config, "attention_bias", config.model_type == "qwen2")),
            tie_word_embeddings=bool(config.tie_word_embeddings),
        )


#: Llama-3-8B's published shapes (meta-llama/Meta-Llama-3-8B config.json), RoPE scaling left out.
LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, intermediate_size=14336,
                        rope_theta=500000.0, rms_norm_eps=1e-5)  # fmt: skip


def new_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: Any
) -> list[torch.Tensor]:
    """Allocate ``[k_0, v_0, k_1, v_1, ...]``, each ``[num_blocks, block_size, kv_heads,
    head_dim]`` of ``dtype`` on ``device`` (uninitialised memory)."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [torch.empty(shape, dtype=dtype, device=device) for _ in range(2 * config.num_layers)]


@dataclasses.dataclass
class StepBatch:
    """One step's tokens, flattened over requests; decodes (one token each) come first.

    Attributes:
        input_ids, positions, slot_mapping: int64 ``[T]`` on the model's device.
        query_start_loc: host ints ``[R + 1]``: request ``r`` owns tokens ``qsl[r]:qsl[r+1]``.
        context_lens: host ints ``[R]``: tokens in the cache after this step (past + new).
        block_tables: int64 ``[R, max_blocks]`` on the device (rows padded with 0 past the
            request's blocks; padding is masked out).
        num_decodes: the first ``num_decodes`` requests have exactly one new token.
        sample_rows: int64 ``[S]``: token indices whose logits are wanted (end of a prompt or
            a decode step).
        decode_valid, prefill_masks: attention masks, built once per step by ``prepare``
            (bool ``[D, max_context]``; per prefill request ``[qlen, context]`` or ``None`` for
            a chunk without a past, which is plain causal).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    num_decodes: int
    sample_rows: torch.Tensor
    decode_valid: torch.Tensor | None = None
    prefill_masks: list[torch.Tensor | None] = dataclasses.field(default_factory=list)

    def prepare(self) -> None:
        """Build the masks that every layer shares."""
        dev, d = self.input_ids.device, self.num_decodes
        if d:
            ctx = max(self.context_lens[:d])
            lens = torch.tensor(self.context_lens[:d], device=dev)
            self.decode_valid = torch.arange(ctx, device=dev) < lens[:, None]
        self.prefill_masks = []
        for r in range(d, len(self.context_lens)):
            qlen, ctx = self.query_start_loc[r + 1] - self.query_start_loc[r], self.context_lens[r]
            if ctx == qlen:
                self.prefill_masks.append(None)
            else:  # causal with an offset: new token i (position ctx - qlen + i) sees 0..that
                mask = torch.ones(qlen, ctx, dtype=torch.bool, device=dev)
                self.prefill_masks.append(mask.tril(diagonal=ctx - qlen))


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # LlamaRMSNorm's math
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Attention(nn.Module):
    def __init__(self, c: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.c = c
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, q, bias=c.qkv_bias, **factory)
        self.k_proj = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias, **factory)
        self.v_proj = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias, **factory)
        self.o_proj = nn.Linear(q, c.hidden_size, bias=False, **factory)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        b: StepBatch,
    ) -> torch.Tensor:
        c, t = self.c, x.shape[0]
        q = self.q_proj(x).view(t, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        cos, sin = rope
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_cache, v_cache = kv
        block_size = k_cache.shape[1]
        # write the new tokens' K/V into their slots, then attend over the paged context
        k_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, b.slot_mapping, k)
        v_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, b.slot_mapping, v)
        out = torch.empty_like(q)
        groups = c.num_heads // c.num_kv_heads
        d = b.num_decodes
        if d:
            valid = b.decode_valid  # [D, L]
            assert valid is not None, "call batch.prepare() first"
            ctx = valid.shape[1]
            nb = -(-ctx // block_size)
            keys = _gather(k_cache, b.block_tables[:d, :nb], ctx, groups, valid)  # [D, H, L, hd]
            vals = _gather(v_cache, b.block_tables[:d, :nb], ctx, groups, valid)
            mask = valid[:, None, None, :]
            o = F.scaled_dot_product_attention(q[:d, :, None, :], keys, vals, attn_mask=mask)
            out[:d] = o[:, :, 0, :]
        for r in range(d, len(b.context_lens)):
            lo, hi, ctx = b.query_start_loc[r], b.query_start_loc[r + 1], b.context_lens[r]
            nb = -(-ctx // block_size)
            keys = _gather(k_cache, b.block_tables[r : r + 1, :nb], ctx, groups)
            vals = _gather(v_cache, b.block_tables[r : r + 1, :nb], ctx, groups)
            qr = q[lo:hi].transpose(0, 1)[None]  # [1, H, qlen, hd]
            mask = b.prefill_masks[r - d]
            if mask is None:  # no past: plain causal (lets SDPA pick a flash kernel)
                o = F.scaled_dot_product_attention(qr, keys, vals, is_causal=True)
            else:
                o = F.scaled_dot_product_attention(qr, keys, vals, attn_mask=mask)
            out[lo:hi] = o[0].transpose(0, 1)
        return self.o_proj(out.reshape(t, -1))


def _gather(
    cache: torch.Tensor,
    table: torch.Tensor,
    ctx: int,
    groups: int,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """``cache[table]`` -> ``[R, heads, ctx, head_dim]`` (KV heads repeated ``groups`` times).

    Slots past a request's length (``valid`` False) hold whatever the block held, NaN
    included; they are zeroed so that a masked-out NaN cannot leak in as ``0 * NaN``.
    """
    r, nb = table.shape
    blocks = cache[table]  # [R, nb, block_size, kv_heads, hd]
    flat = blocks.reshape(r, nb * cache.shape[1], cache.shape[2], cache.shape[3])[:, :ctx]
    if valid is not None:
        flat = flat.masked_fill(~valid[:, :, None, None], 0.0)
    return flat.transpose(1, 2).repeat_interleave(groups, dim=1)


class _MLP(nn.Module):
    def __init__(self, c: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.self_attn = _Attention(c, **factory)
        self.mlp = _MLP(c, **factory)
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)


class _Backbone(nn.Module):
    def __init__(self, c: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, **factory)
        self.layers = nn.ModuleList(_Layer(c, **factory) for _ in range(c.num_layers))
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)


class PagedDecoder(nn.Module):
    """The model. ``forward(batch, kv_caches)`` returns float32 logits ``[S, vocab]`` of the
    rows ``batch.sample_rows``; it writes the step's K/V into ``kv_caches`` in place."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.config = config
        self.model = _Backbone(config, **factory)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        c = config
        inv_freq = 1.0 / (
            c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float) / c.head_dim)
        )
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    @classmethod
    def from_hf(cls, hf_model: nn.Module, *, dtype: torch.dtype, device: Any) -> PagedDecoder:
        """Copy the weights of a ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``.

        Raises:
            ValueError: unsupported config, or weights that do not match the module names.
        """
        model = cls(ModelConfig.from_hf(hf_model.config), dtype=dtype, device=device)
        state = dict(hf_model.state_dict())
        if model.config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        unexpected = [k for k in unexpected if "rotary_emb" not in k]
        if missing or unexpected:
            raise ValueError(f"weights do not match: missing {missing}, unexpected {unexpected}")
        return model.eval()

    @classmethod
    def random(
        cls, config: ModelConfig, *, seed: int, dtype: torch.dtype, device: Any, std: float = 0.02
    ) -> PagedDecoder:
        """Random weights (normal, ``std``; norms at one) drawn from ``seed`` on ``device``."""
        model = cls(config, dtype=dtype, device=device)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std, generator=gen)
        return model.eval()

    @torch.inference_mode()
    def forward(
        self,
        b: StepBatch,
        kv_caches: list[torch.Tensor],
        before_attention: Any = None,
        after_attention: Any = None,
    ) -> torch.Tensor:
        """``before_attention(i)``, if given, runs right before layer ``i``'s attention reads the
        cache (``LayerwiseLoad.wait_layer``: a stream wait, no host sync); ``after_attention(i)``
        right after layer ``i``'s attention wrote the step's K/V (``LayerwiseStore.save_layer``:
        the layer's copy starts there, fenced on the compute stream)."""
        b.prepare()
        x = self.model.embed_tokens(b.input_ids)
        freqs = b.positions[:, None].float() * self.inv_freq  # LlamaRotaryEmbedding's math
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, head_dim]
        rope = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        for i, layer in enumerate(self.model.layers):
            kv = (kv_caches[2 * i], kv_caches[2 * i + 1])
            if before_attention is not None:
                before_attention(i)
            x = x + layer.self_attn(layer.input_layernorm(x), rope, kv, b)
            if after_attention is not None:
                after_attention(i)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.model.norm(x[b.sample_rows])
        return self.lm_head(x).float()
