"""The example engine (examples/engine) is token-exact against Hugging Face ``generate``.

A tiny random Llama (float32, CPU) serves prompts that share prefixes, with GPU blocks scarce
enough that requests are preempted through kvmgr and later requests load their prefix from the
CPU tier. Every request's greedy tokens must equal ``model.generate(do_sample=False)`` run on
it alone, and equal the engine's own run with the CPU tier disabled; the logits of the first
generated token must match HF's within 1e-4 (float32; the sums run in a different order).
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch

from examples.engine import bench
from examples.engine.engine import Engine, EngineConfig, Request, block_keys
from examples.engine.model import PagedDecoder, new_kv_caches
from kvmgr import ManagerConfig, OffloadManager
from kvmgr.testing import check_invariants

BLOCK_SIZE = 4
MAX_NEW_TOKENS = 14
LOGITS_ATOL = 1e-4


def _hf_model(kind: str) -> torch.nn.Module:
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed: pip install -e '.[engine]'"
    )
    common = dict(
        vocab_size=211,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        initializer_range=0.2,  # well-separated logits: argmax is not decided by rounding
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(1234)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
    return transformers.Qwen2ForCausalLM(config).eval()


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    system = [rng.randrange(1, 211) for _ in range(22)]
    doc = [rng.randrange(1, 211) for _ in range(13)]
    prompts = []
    for i in range(9):
        prefix = system + doc if i % 3 == 0 else system
        prompts.append(prefix + [rng.randrange(1, 211) for _ in range(3 + 2 * i)])
    prompts.append(list(prompts[1]))  # an exact repeat
    return prompts


def _reference(hf: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        logits = hf(ids).logits[0, -1].float()
    return out[0, len(prompt) :].tolist(), logits


async def _serve(
    model: PagedDecoder,
    prompts: list[list[int]],
    *,
    offload: bool,
    engine_name: str = "host",
    layerwise: bool = False,
):
    device = next(model.parameters()).device
    kv = new_kv_caches(model.config, 32, BLOCK_SIZE, torch.float32, device)
    for t in kv:  # poison: a block read before it was written shows up as NaN
        t.fill_(float("nan"))
    config = ManagerConfig(num_cpu_blocks=160 if offload else 1, engine=engine_name)
    async with OffloadManager(kv, config) as mgr:
        engine = Engine(
            model,
            kv,
            mgr,
            EngineConfig(
                block_size=BLOCK_SIZE,
                token_budget=16,
                max_num_seqs=4,
                offload=offload,
                layerwise=layerwise,
            ),
            on_step=check_invariants,
        )
        requests = [Request(i, p, MAX_NEW_TOKENS) for i, p in enumerate(prompts)]
        stats = await engine.run(requests)
        check_invariants(mgr)
        return requests, stats, mgr.statistics()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_engine_is_token_exact_with_preemption_and_cpu_hits(kind: str) -> None:
    hf = _hf_model(kind)
    model = PagedDecoder.from_hf(hf, dtype=torch.float32, device="cpu")
    prompts = _prompts()

    served, stats, mgr_stats = asyncio.run(_serve(model, prompts, offload=True))
    # the scenario did what it is meant to exercise
    assert stats.preemptions >= 1 and stats.recompute_preemptions == 0, stats
    assert mgr_stats.loads_completed > 0 and stats.hit_tokens > 0, (stats, mgr_stats)
    assert mgr_stats.lookup_hits > 0 and mgr_stats.stores_completed > 0, mgr_stats

    baseline, base_stats, _ = asyncio.run(_serve(model, prompts, offload=False))
    assert base_stats.hit_tokens == 0
    for req, base, prompt in zip(served, baseline, prompts):
        tokens, logits = _reference(hf, prompt)
        assert req.output == tokens, f"request {req.req_id}: engine vs HF generate"
        assert base.output == tokens, f"request {req.req_id}: no-offload engine vs HF"
        torch.testing.assert_close(req.first_logits, logits, atol=LOGITS_ATOL, rtol=0)
    # the CPU hits saved prefill work: fewer tokens computed than without the tier
    assert stats.prefill_tokens < base_stats.prefill_tokens


def test_layerwise_prefix_loads_are_token_exact() -> None:
    """Hits load layer by layer in the step that computes their suffix: same tokens as HF."""
    hf = _hf_model("llama")
    model = PagedDecoder.from_hf(hf, dtype=torch.float32, device="cpu")
    prompts = _prompts()
    served, stats, mgr_stats = asyncio.run(_serve(model, prompts, offload=True, layerwise=True))
    assert stats.layerwise_steps > 0 and stats.hit_tokens > 0, stats
    assert stats.layerwise_failed == 0 and mgr_stats.loads_completed > 0
    for req, prompt in zip(served, prompts):
        tokens, logits = _reference(hf, prompt)
        assert req.output == tokens, f"request {req.req_id}: layerwise engine vs HF generate"
        torch.testing.assert_close(req.first_logits, logits, atol=LOGITS_ATOL, rtol=0)


def test_block_keys_chain_prefixes() -> None:
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_keys([1, 2, 3, 4, 5, 6, 7, 0], 4)
    c = block_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2  # partial blocks have no key
    assert a[0] == b[0] and a[1] != b[1]  # same first block, different second
    assert c[0] != a[0] and c[1] != a[1]  # a key names its whole prefix


def test_bench_tiny_runs_and_reuses_prefixes(tmp_path) -> None:
    out = tmp_path / "engine.json"
    assert bench.main(["--tiny", "--requests", "16", "--json", str(out)]) == 0
    results = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"recompute", "auto"}  # no "cuda" without a GPU
    base, auto = results["recompute"], results["auto"]
    assert base["requests"] == auto["requests"] == 16
    assert base["hit_tokens"] == 0 and auto["hit_tokens"] > 0
    assert auto["prefill_tokens"] < base["prefill_tokens"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "engine_name", ["auto", "cuda", "kernel", "auto-layerwise", "cuda-layerwise"]
)
def test_engine_on_cuda_equals_its_run_without_offload(engine_name: str) -> None:
    # the same scenario on the GPU (no transformers needed): a random float32 model, the KV
    # moved by the real copy engines; outputs must equal the run that never offloads
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    config = bench.TINY
    model = PagedDecoder.random(config, seed=3, dtype=torch.float32, device="cuda", std=0.2)
    prompts = [[t % config.vocab_size for t in p] for p in _prompts()]
    layerwise = engine_name.endswith("-layerwise")
    engine_name = engine_name.removesuffix("-layerwise")
    served, stats, mgr_stats = asyncio.run(
        _serve(model, prompts, offload=True, engine_name=engine_name, layerwise=layerwise)
    )
    assert stats.preemptions >= 1 and mgr_stats.loads_completed > 0, (stats, mgr_stats)
    baseline, _, _ = asyncio.run(_serve(model, prompts, offload=False, engine_name=engine_name))
    for req, base in zip(served, baseline):
        assert req.output == base.output, f"request {req.req_id}"
        torch.testing.assert_close(req.first_logits, base.first_logits, atol=LOGITS_ATOL, rtol=0)
