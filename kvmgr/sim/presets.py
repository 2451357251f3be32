"""Model geometry presets: how many KV tensors a model has and how many bytes a token takes.

Offers:
    ModelPreset     one geometry: tensors, bytes per token per tensor, dtype of the pages
    MODEL_PRESETS   the registry by name (a plain dict, never mutated)
    get_preset      look one up; an unknown name lists the known ones

Page bytes of tensor ``t`` = ``bytes_per_token * block_size``; a block is one page in every
tensor. Figures come from each model's ``config.json``:

- ``tiny``: a toy geometry so a whole trace fits a laptop: 1 layer x (K, V), 1 KV head of dim 2,
  bf16: 4 B per token per tensor.
- ``qwen2.5-0.5b``: 24 layers x (K, V) = 48 tensors; 2 KV heads x 64 dims x 2 B = 256 B/token.
- ``llama-3-8b``: 32 layers x (K, V) = 64 tensors; 8 KV heads x 128 dims x 2 B = 2,048 B/token.
- ``deepseek-mla``: DeepSeek-V3/R1 MLA, 61 layers, one latent tensor per layer holding
  ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 values in bf16: 1,152 B/token.
- ``deepseek-mla-fp8``: the same with vLLM's FP8 MLA cache layout: 512 FP8 latent bytes, four
  fp32 scales (one per 128 values, 16 B) and the 64 RoPE dims in bf16 (128 B): 656 B/token.
"""

from __future__ import annotations

import attrs

from kvmgr.errors import ConfigError

__all__ = ["MODEL_PRESETS", "ModelPreset", "get_preset"]


@attrs.frozen(kw_only=True)
class ModelPreset:
    """A KV-cache geometry.

    Attributes:
        name: registry name.
        num_tensors: KV tensors (layers, or layers x K/V).
        bytes_per_token: bytes one token occupies in one tensor (a multiple of 8 at every block
            size the simulation accepts, since pages are fingerprinted in int64 words).
        description: one line for ``--help`` and the report.
    """

    name: str
    num_tensors: int
    bytes_per_token: int
    description: str

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one page (one block in one tensor)."""
        return self.bytes_per_token * block_size

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block across all tensors."""
        return self.page_bytes(block_size) * self.num_tensors


MODEL_PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            name="tiny",
            num_tensors=2,
            bytes_per_token=4,
            description="toy: 1 layer x K,V, 1 head x 2 dims, bf16 (laptop-sized)",
        ),
        ModelPreset(
            name="qwen2.5-0.5b",
            num_tensors=48,
            bytes_per_token=256,
            description="Qwen2.5-0.5B: 24 layers x K,V, 2 KV heads x 64, bf16",
        ),
        ModelPreset(
            name="llama-3-8b",
            num_tensors=64,
            bytes_per_token=2048,
            description="Llama-3-8B: 32 layers x K,V, 8 KV heads x 128, bf16",
        ),
        ModelPreset(
            name="deepseek-mla",
            num_tensors=61,
            bytes_per_token=1152,
            description="DeepSeek-V3 MLA: 61 layers x (512 + 64) bf16",
        ),
        ModelPreset(
            name="deepseek-mla-fp8",
            num_tensors=61,
            bytes_per_token=656,
            description="DeepSeek-V3 MLA, FP8 cache: 512 fp8 + 4 fp32 scales + 64 bf16",
        ),
    )
}
"""Presets by name."""


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``.

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    preset = MODEL_PRESETS.get(name)
    if preset is None:
        raise ConfigError(f"unknown model preset {name!r}; known: {', '.join(MODEL_PRESETS)}")
    return preset
