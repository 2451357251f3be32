"""``kvmgr bench vllm`` runs (two steps a variant) and reports every row it promises."""

from __future__ import annotations

import vllm_support  # noqa: F401  (skips without vLLM, fails in CI; silences import warnings)

from kvmgr.bench import vllm as bench


def test_bench_vllm_measures_every_variant() -> None:
    rows = bench.measure(steps=2, policies=("arc",))
    got = {(r["policy"], r["scenario"], r["api"]) for r in rows}
    want = {
        (policy, scenario, api)
        for policy in ("arc",)
        for scenario, apis in bench.SCENARIOS
        for api in apis
    }
    assert got == want
    assert all(r["kvmgr_p50_us"] > 0 and r["vllm_p50_us"] > 0 and r["ratio"] > 0 for r in rows)
    assert "| arc | store 512 x 1 | batched |" in bench._table(rows)


def test_interleaved_counts_the_same_steps_for_every_side() -> None:
    import asyncio

    samples = asyncio.run(
        bench._interleaved("lru", "mixed 64 x 8 + 16 x 16", ("backend", "per-call"), 3)
    )
    assert sorted(samples) == ["backend", "per-call", "vllm"]
    assert all(len(s) == 3 and min(s) > 0 for s in samples.values())
