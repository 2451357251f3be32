"""kvmgr's DeepSeek-V4 references against vLLM's own Triton kernels (the real vllm package).

vLLM's compressor kernels run here under the Triton interpreter (``conftest.py`` routes its FP8
conversion through torch, as for kvmgr's kernels), on the same random state: the state write
must match bit for bit, and the c4 and indexer entries must agree once decoded from each side's
layout (vLLM keeps a block's scales after its data; kvmgr's entries are contiguous). vLLM rounds
the normed values to bf16 before it quantizes, and kvmgr's references quantize the fp32 result,
so a value may differ by one FP8 step and, rarely, a scale by one power of two.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import textwrap
import warnings
from typing import Any

import pytest
import torch
import triton

from kvmgr.kernels.c128.reference import c128_unpack, rope_cos_sin_cache
from kvmgr.kernels.c128.v4_reference import (
    c4_compress_ref,
    compressor_state_write_ref,
    indexer_compress_ref,
)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter parity: CPU only")

STATE_BLOCK, CACHE_BLOCK, T = 4, 8, 44  # positions 0..43: the first windows reach below 0


def _vllm_kernel(module: str, name: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``triton.jit`` of one of vLLM's kernels, from the installed package's own source.

    Without a GPU driver vLLM swaps Triton for placeholders (its ``HAS_TRITON`` is false), which
    leave its kernels plain Python functions; their source is compiled here against the real
    Triton, so the interpreter runs vLLM's code unchanged.
    """
    with warnings.catch_warnings():  # the peer's import warns (torch.jit deprecations, ...)
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm")
        mod = importlib.import_module(f"vllm.models.deepseek_v4.common.ops.{module}")
    owner, _, attr = name.rpartition(".")
    fn = getattr(getattr(mod, owner) if owner else mod, attr)
    lines = textwrap.dedent(inspect.getsource(fn)).splitlines()
    body = "\n".join(lines[next(i for i, ln in enumerate(lines) if ln.startswith("def ")) :])
    path = tmp_path_factory.mktemp("vllm_src") / f"{attr.strip('_')}.py"
    path.write_text(f"import triton\nimport triton.language as tl\n\n\n{body}\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return triton.jit(getattr(loaded, attr))


def _scenario(head_dim: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = 2 * head_dim  # overlap: coff = 2
    num_blocks = T // STATE_BLOCK + 3
    table = torch.randperm(num_blocks, generator=gen)[: T // STATE_BLOCK + 1].to(torch.int32)[None]
    pos = torch.arange(T)
    slots = table[0, pos // STATE_BLOCK].long() * STATE_BLOCK + pos % STATE_BLOCK
    return {
        "kv": torch.randn(T, width, generator=gen), "score": 3 * torch.randn(T, width, generator=gen),
        "ape": torch.randn(4, width, generator=gen), "pos": pos, "slots": slots, "table": table,
        "state": torch.randn(num_blocks, STATE_BLOCK, 2 * width, generator=gen),
        "norm": 0.5 + torch.rand(head_dim, generator=gen), "cos_sin": rope_cos_sin_cache(T + 1),
        "out_slots": torch.randperm(T // CACHE_BLOCK * CACHE_BLOCK + CACHE_BLOCK, generator=gen)[:T],
    }  # fmt: skip


def _vllm_compress(kernel: Any, s: dict[str, torch.Tensor], head_dim: int, entry: int) -> torch.Tensor:  # fmt: skip
    """vLLM's fused compress-norm-rope-store into its paged layout, returned in kvmgr's entry
    layout ``[blocks, bs, entry]`` (its block keeps all token data first, then all scales)."""
    cache = torch.zeros(T // CACHE_BLOCK + 1, CACHE_BLOCK, entry, dtype=torch.uint8)
    big = head_dim == 512
    data = 576 if big else 128  # per-token data bytes
    state, table = s["state"], s["table"]
    kernel[(T,)](
        state, state.stride(0), state.stride(1), torch.zeros(T, dtype=torch.int32), s["pos"],
        s["slots"], table, table.stride(0), STATE_BLOCK, s["norm"], 1e-6, s["cos_sin"],
        s["cos_sin"].stride(0), cache, s["out_slots"], CACHE_BLOCK,
        HEAD_SIZE=head_dim, TRITON_BLOCK_SIZE=head_dim, STATE_WIDTH=2 * head_dim,
        COMPRESS_RATIO=4, OVERLAP=True, ROPE_HEAD_DIM=64, FP8_MAX=448.0,
        QUANT_BLOCK=64 if big else 128, TOKEN_STRIDE=data, SCALE_DIM=8 if big else 4,
        KV_BLOCK_STRIDE=cache.stride(0),
        **({"SANITIZE_CACHE_NANS": False} if big else {"MX_SCALE": False}),
    )  # fmt: skip
    flat = cache.view(cache.shape[0], -1)
    rows = flat[:, : CACHE_BLOCK * data].reshape(-1, CACHE_BLOCK, data)
    scales = flat[:, CACHE_BLOCK * data :].reshape(-1, CACHE_BLOCK, entry - data)
    return torch.cat([rows, scales], dim=2)


def _within_one_fp8_step(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> bool:
    """``|a - b|`` within one e4m3 step of the larger value (3 mantissa bits), or of the
    subnormal step ``2**-9 * scale``, where ``scale`` is the larger of the two scales."""
    step = torch.maximum(a.abs(), b.abs()) * 2**-3 + scale * 2**-9
    return bool(((a - b).abs() <= step).all())


def _written(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return s["out_slots"][(s["pos"] + 1) % 4 == 0]


@pytest.mark.parametrize("seed", [0, 1])
def test_state_write_matches_vllm_bit_for_bit(seed, tmp_path_factory):
    kernel = _vllm_kernel("save_partial_states", "SavePartialStatesKernel.kernel", tmp_path_factory)
    s = _scenario(512, seed)
    ours, theirs = s["state"].clone(), s["state"].clone()
    compressor_state_write_ref(s["kv"], s["score"], s["ape"], s["pos"], s["slots"], ours, ratio=4)
    kv, score, ape = s["kv"], s["score"], s["ape"]
    kernel[(T,)](kv, kv.stride(0), score, score.stride(0), ape, ape.stride(0), s["pos"], theirs,
                 theirs.stride(0), theirs.stride(1), s["slots"], STATE_BLOCK, HEAD_SIZE=1024,
                 TRITON_BLOCK_SIZE=1024, STATE_WIDTH=1024, COMPRESS_RATIO=4)  # fmt: skip
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


def _compressed_rows(
    attn: str, reference: Any, head: int, width: int, seed: int, tmp_path_factory: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ours (``reference``) and vLLM's fused compressor kernel for ``attn`` on one scenario:
    the cache rows they wrote, ``[rows, width]`` bytes each (ours first)."""
    kernel = _vllm_kernel(
        "fused_compress_quant_cache",
        f"_fused_kv_compress_norm_rope_insert_{attn}",
        tmp_path_factory,
    )
    s = _scenario(head, seed)
    theirs = _vllm_compress(kernel, s, head, width)
    ours = torch.zeros_like(theirs)
    reference(s["state"], s["table"], torch.zeros(T, dtype=torch.int32), s["pos"],
              s["out_slots"], s["norm"], s["cos_sin"], ours)  # fmt: skip
    rows = _written(s)
    return ours.view(-1, width)[rows], theirs.view(-1, width)[rows]


@pytest.mark.parametrize("seed", [0, 1])
def test_c4_compressor_matches_vllm(seed, tmp_path_factory):
    both = _compressed_rows("sparse_attn", c4_compress_ref, 512, 584, seed, tmp_path_factory)
    (n_ours, r_ours, e_ours), (n_theirs, r_theirs, e_theirs) = map(c128_unpack, both)
    assert (e_ours == e_theirs).float().mean() >= 0.95  # a bf16 rounding may cross a power of 2
    scale = torch.exp2(torch.maximum(e_ours, e_theirs).float()).repeat_interleave(64, dim=-1)
    assert _within_one_fp8_step(n_ours, n_theirs, scale)
    torch.testing.assert_close(r_ours, r_theirs, rtol=2**-7, atol=1e-6)  # one bf16 step


@pytest.mark.parametrize("seed", [0, 1])
def test_indexer_compressor_matches_vllm(seed, tmp_path_factory):
    ours, theirs = _compressed_rows(
        "indexer_attn", indexer_compress_ref, 128, 132, seed, tmp_path_factory
    )

    def decode(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = e[:, 128:].contiguous().view(torch.float32)
        return e[:, :128].contiguous().view(torch.float8_e4m3fn).float() * scale, scale

    (v_ours, s_ours), (v_theirs, s_theirs) = decode(ours), decode(theirs)
    assert (s_ours == s_theirs).float().mean() >= 0.9
    assert _within_one_fp8_step(v_ours, v_theirs, torch.maximum(s_ours, s_theirs))
