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
from examples.engine.graphs import DecodeGraphs
from examples.engine.model import PagedDecoder, StepBatch, new_kv_caches
from kvmgr import ManagerConfig, OffloadManager
from kvmgr.testing import check_invariants

BLOCK_SIZE = 4
MAX_NEW_TOKENS = 14
LOGITS_ATOL = 1e-4


def _hf_model(kind: str) -> torch.nn.Module:
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed: pip install -e '.[engine]'"
    )
    common = dict(vocab_size=211, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96,
                  initializer_range=0.2,  # well-separated logits: argmax is not decided by rounding
                  bos_token_id=None, eos_token_id=None, pad_token_id=0)  # fmt: skip
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
    decode_graphs: bool = False,
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
                decode_graphs=decode_graphs,
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
    """Hits load layer by layer in the step that computes their suffix, decode steps run the
    static-shape decode of graphs.py: same tokens as HF."""
    hf = _hf_model("llama")
    model = PagedDecoder.from_hf(hf, dtype=torch.float32, device="cpu")
    prompts = _prompts()
    served, stats, mgr_stats = asyncio.run(
        _serve(model, prompts, offload=True, layerwise=True, decode_graphs=True)
    )
    assert stats.layerwise_steps > 0 and stats.hit_tokens > 0, stats
    assert stats.graph_steps > 0, stats
    assert stats.layerwise_failed == 0 and mgr_stats.loads_completed > 0
    assert stats.layerwise_stores > 0, stats  # the hits load what the forward saved per layer
    for req, prompt in zip(served, prompts):
        tokens, logits = _reference(hf, prompt)
        assert req.output == tokens, f"request {req.req_id}: layerwise engine vs HF generate"
        torch.testing.assert_close(req.first_logits, logits, atol=LOGITS_ATOL, rtol=0)


def _decode_batch(device: str, block_size: int) -> tuple[StepBatch, int]:
    """Three decodes with contexts 5, 9 and 3 tokens over blocks 1-6 (the pad block: 39)."""
    ctx, tables = [5, 9, 3], [[1, 2], [3, 4, 5], [6]]
    bt = torch.zeros(3, 3, dtype=torch.int64)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    slots = [tables[i][(c - 1) // block_size] * block_size + (c - 1) % block_size
             for i, c in enumerate(ctx)]  # fmt: skip
    batch = StepBatch(
        input_ids=torch.tensor([5, 7, 9], device=device),
        positions=torch.tensor([c - 1 for c in ctx], device=device),
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=[0, 1, 2, 3],
        context_lens=ctx,
        block_tables=bt.to(device),
        num_decodes=3,
        sample_rows=torch.tensor([0, 1, 2], device=device),
    )
    return batch, 39 * block_size


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decode_graphs_match_the_eager_decode(device: str) -> None:
    model = PagedDecoder.random(bench.TINY, seed=1, dtype=torch.float32, device=device, std=0.2)
    kv = new_kv_caches(bench.TINY, 40, 4, torch.float32, device)
    for t in kv:
        t.normal_()
    before = [t.clone() for t in kv]
    batch, pad = _decode_batch(device, 4)
    eager = model(batch, kv)
    after_eager = [t.clone() for t in kv]
    for t, b in zip(kv, before):
        t.copy_(b)
    graphs = DecodeGraphs(model, kv, max_blocks=4, pad_slot=pad, capture=False, max_batch=8)
    assert graphs.fits(batch)
    static = graphs.run(_decode_batch(device, 4)[0])  # padded to a bucket of 4
    torch.testing.assert_close(static, eager, atol=1e-4, rtol=0)
    # the same slots were written, with the same numbers up to float rounding (a padded batch of
    # 4 runs other matmul shapes than the eager batch of 3: bit equality depends on the CPU's BLAS
    # kernels, e.g. it held on Intel and not on AMD EPYC), and nothing else but the pad block
    for t, e, b in zip(kv, after_eager, before):
        untouched = e[:39] == b[:39]  # what the eager decode left alone
        assert not bool(untouched.all())
        assert torch.equal(t[:39][untouched], b[:39][untouched])
        torch.testing.assert_close(t[:39], e[:39], atol=1e-4, rtol=0)
    if device == "cuda":  # captured and replayed: the same numbers as the static code eagerly
        for t, b in zip(kv, before):
            t.copy_(b)
        captured = DecodeGraphs(model, kv, max_blocks=4, pad_slot=pad, capture=True, max_batch=8)
        first = captured.run(_decode_batch(device, 4)[0])
        for t, b in zip(kv, before):
            t.copy_(b)
        again = captured.run(_decode_batch(device, 4)[0])  # a replay
        assert captured.replays == 2
        torch.testing.assert_close(first, static, atol=1e-4, rtol=0)
        assert torch.equal(first, again)


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


def test_bench_multiturn_slice_reuses_and_loads_layerwise(tmp_path) -> None:
    out = tmp_path / "engine.json"
    argv = ["--tiny", "--slice", "multiturn", "--requests", "8", "--turns", "4", "--rounds", "1",
            "--variants", "recompute,auto-layerwise", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    results = {r["variant"]: r for r in data["results"]}
    layerwise = results["auto-layerwise"]
    # turn k's prompt extends turn k-1's: most of it is loaded, layer by layer
    assert layerwise["hit_tokens"] > layerwise["prefill_tokens"] > 0
    assert layerwise["layerwise_steps"] > 0 and layerwise["layerwise_failed"] == 0
    probe = data["meta"]["hit_probe"]
    assert probe["load_s"] > 0 and probe["compute_s"] > 0 and probe["layerwise_s"] > 0


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
    if layerwise:
        assert stats.layerwise_steps > 0 and stats.layerwise_failed == 0, stats
    assert stats.preemptions >= 1 and mgr_stats.loads_completed > 0, (stats, mgr_stats)
    baseline, _, _ = asyncio.run(_serve(model, prompts, offload=False, engine_name=engine_name))
    for req, base in zip(served, baseline):
        assert req.output == base.output, f"request {req.req_id}"
        torch.testing.assert_close(req.first_logits, base.first_logits, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.gpu
def test_engine_decodes_in_cuda_graphs_on_the_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    config = bench.TINY
    model = PagedDecoder.random(config, seed=3, dtype=torch.float32, device="cuda", std=0.2)
    prompts = [[t % config.vocab_size for t in p] for p in _prompts()]
    served, stats, _ = asyncio.run(
        _serve(model, prompts, offload=True, engine_name="auto", layerwise=True, decode_graphs=True)
    )
    assert stats.graph_steps > 0 and stats.layerwise_steps > 0, stats
    baseline, _, _ = asyncio.run(_serve(model, prompts, offload=False, engine_name="auto"))
    for req, base in zip(served, baseline):  # the first token comes from a prefill step
        assert req.output[0] == base.output[0], f"request {req.req_id}"
        torch.testing.assert_close(req.first_logits, base.first_logits, atol=LOGITS_ATOL, rtol=0)
