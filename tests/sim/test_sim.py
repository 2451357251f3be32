"""``kvmgr simulate``: trace parsing, block keys, the reuse ceiling, the GPU prefix cache, page
fingerprints, and the whole loop end to end on the host engine.

End-to-end runs use a slice of the bundled Mooncake trace or small synthetic traces built to
force CPU hits, evictions and preemptions; every run asserts the report's invariants
(hits + misses = lookups, bytes = pages x page bytes, every loaded page verified, zero
mismatches).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from kvmgr.errors import ConfigError, TransferError
from kvmgr.sim import cli
from kvmgr.sim.ceiling import reuse_ceiling
from kvmgr.sim.gpu_cache import GPUPrefixCache
from kvmgr.sim.keys import KEY_BYTES, BlockKeyer, private_key
from kvmgr.sim.loop import SimConfig, simulate
from kvmgr.sim.pages import PageStore
from kvmgr.sim.report import SimReport, render_report
from kvmgr.sim.trace import TraceError, TraceRequest, default_trace_path, load_trace
from kvmgr.testing import FaultyEngine, ScriptedEngine
from kvmgr.transfer import Direction, HostEngine

# A synthetic trace whose reuse is worked out by hand (512-token trace blocks):
#   A: 2 full blocks (1), (1,2) + a partial block         -> all new
#   B: (1) (1,2) hit, (1,2,4) new                          -> 1024 tokens hit
#   C: (1) hit, partial block                              -> 512 hit
#   D: (7) new, (7,2) new: id 2 under another prefix       -> 0
#   E: (1) (1,2) hit; its partial block [3] is never reusable, although A had it -> 1024
_SYNTHETIC = [
    TraceRequest(0.0, 1124, 5, (1, 2, 3)),
    TraceRequest(0.5, 1536, 7, (1, 2, 4)),
    TraceRequest(1.0, 600, 3, (1, 9)),
    TraceRequest(1.5, 1024, 9, (7, 2)),
    TraceRequest(2.0, 1200, 4, (1, 2, 3)),
]


@pytest.fixture(scope="module")
def mooncake() -> list[TraceRequest]:
    return load_trace(default_trace_path(), limit=400)


def _preempting_trace() -> list[TraceRequest]:
    """Ten requests sharing their first block, long outputs: a 192-block GPU must preempt."""
    return [
        TraceRequest(0.01 * i, 1100 + 37 * i, 300 + 50 * (i % 3), (0, 100 + i, 200 + i))
        for i in range(10)
    ]


_TIGHT = dict(block_size=16, gpu_tokens=3 * 1024, watermark=0.0, max_batched_tokens=512)


def _check_invariants(report: SimReport, num_requests: int) -> None:
    c, s = report.counters, report.settings
    assert c["requests_done"] + c["requests_rejected"] == c["requests_arrived"] == num_requests
    assert c["gpu_hit_blocks"] + c["cpu_hit_blocks"] + c["miss_blocks"] == c["lookup_blocks"]
    assert c["gpu_hit_tokens"] + c["cpu_hit_tokens"] + c["miss_tokens"] == c["prompt_tokens"]
    assert report.prefill_tokens_saved == c["gpu_hit_tokens"] + c["cpu_hit_tokens"]
    for d in (report.d2h, report.h2d):
        assert d["bytes"] == d["pages"] * s["page_bytes"]
        assert d["pages"] == d["blocks"] * s["num_tensors"]
        assert d["descriptors"] <= d["pages"]
    assert report.h2d["blocks"] == c["load_blocks"] + c["resume_blocks"]
    assert report.d2h["blocks"] == (
        c["store_blocks"]
        - c["store_skipped_blocks"]
        - c["store_declined_blocks"]
        - c["store_dropped_blocks"]
        + c["preempt_blocks"]
    )
    assert c["pages_verified"] == report.h2d["blocks"] * s["num_tensors"]
    assert c["page_mismatches"] == 0
    assert report.manager["steps"] == c["steps"]  # exactly one manager.step() per step
    assert report.manager["bytes_d2h"] == report.d2h["bytes"]
    assert report.manager["bytes_h2d"] == report.h2d["bytes"]


# ---------------------------------------------------------------------------- traces


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_mooncake_lines_are_parsed_sorted_and_gzip_is_read(tmp_path: Path) -> None:
    records = [
        {"timestamp": 2500, "input_length": 700, "output_length": 3, "hash_ids": [4, 5]},
        {"timestamp": 1000, "input_length": 512, "output_length": 9, "hash_ids": [4]},
    ]
    text = "".join(json.dumps(r) + "\n" for r in records) + "\n"  # a blank line is skipped
    with gzip.open(tmp_path / "t.jsonl.gz", "wt") as f:
        f.write(text)
    got = load_trace(tmp_path / "t.jsonl.gz")
    assert got == [TraceRequest(0.0, 512, 9, (4,)), TraceRequest(1.5, 700, 3, (4, 5))]
    assert load_trace(_write(tmp_path / "t.jsonl", text.splitlines()), limit=1) == [
        TraceRequest(0.0, 700, 3, (4, 5))
    ]


@pytest.mark.parametrize(
    ("line", "field", "words"),
    [
        ('{"timestamp": 0, "input_length": 10, "output_length": 1', None, "invalid JSON"),
        ("[1, 2]", None, "expected a JSON object"),
        ('{"input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp", "missing"),
        (
            '{"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
            "timestamp",
            ">= 0",
        ),
        (
            '{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": [1]}',
            "input_length",
            "expected an int",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 0, "hash_ids": [1]}',
            "output_length",
            ">= 1",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, "a"]}',
            "hash_ids",
            "list of ints",
        ),
        (
            '{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2]}',
            "hash_ids",
            "expected 3 ids",
        ),
    ],
)
def test_malformed_mooncake_line_names_file_line_and_field(
    tmp_path: Path, line: str, field: str | None, words: str
) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    path = _write(tmp_path / "bad.jsonl", [good, "", good, line])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert info.value.line == 4 and info.value.field == field
    assert f"{path}:4: " in str(info.value) and words in str(info.value)
    if field is not None:
        assert repr(field) in str(info.value)


def test_azure_csv_gets_unique_blocks_and_checks_fields(tmp_path: Path) -> None:
    header = "TIMESTAMP,ContextTokens,GeneratedTokens"
    path = _write(
        tmp_path / "az.csv",
        [header, "2023-11-16 18:15:46.6805900,1300,44", "2023-11-16 18:15:50.1805900,1300,109"],
    )
    got = load_trace(path)
    assert [r.arrival_s for r in got] == pytest.approx([0.0, 3.5])
    assert [r.input_length for r in got] == [1300, 1300]
    assert len(set(got[0].hash_ids + got[1].hash_ids)) == 6  # no prefix is ever shared
    assert reuse_ceiling(got).hit_tokens == 0
    bad = _write(tmp_path / "bad.csv", [header, "2023-11-16 18:15:46,12,3", "yesterday,5,5"])
    with pytest.raises(TraceError, match=r"bad\.csv:3: field 'TIMESTAMP'"):
        load_trace(bad)
    bad = _write(tmp_path / "bad2.csv", [header, "2023-11-16 18:15:46,0,3"])
    with pytest.raises(TraceError, match=r"bad2\.csv:2: field 'ContextTokens': expected >= 1"):
        load_trace(bad)


def test_unreadable_empty_or_unknown_traces_raise_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceError, match="empty"):
        load_trace(_write(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(_write(tmp_path / "x.txt", ["hello,world"]))


# ---------------------------------------------------------------------------- keys, ceiling


def test_keys_chain_prefixes_and_skip_the_partial_block() -> None:
    keyer = BlockKeyer(128)  # 4 sub-blocks per 512-token trace block
    a, b, _, d, e = (keyer.prefix_keys(r) for r in _SYNTHETIC)
    assert [len(k) for k in (a, b, d, e)] == [8, 12, 8, 8]  # partial blocks get no key
    assert all(len(k) == KEY_BYTES for k in a + b + d)
    assert len(set(a + b + d)) == 8 + 4 + 8  # distinct except the shared prefix
    assert b[:8] == a and e == a  # equal prefixes, equal keys
    assert d[4:] != a[4:]  # id 2 after another prefix is another block
    assert BlockKeyer(128).prefix_keys(_SYNTHETIC[1]) == b  # a pure function of the ids
    assert private_key(3, 0) != private_key(0, 3) and len(private_key(3, 0)) == KEY_BYTES
    with pytest.raises(ValueError, match="dividing 512"):
        BlockKeyer(48)


def test_reuse_ceiling_of_a_hand_computed_trace() -> None:
    ceiling = reuse_ceiling(_SYNTHETIC)
    assert ceiling.prompt_tokens == 1124 + 1536 + 600 + 1024 + 1200
    assert ceiling.hit_tokens == 1024 + 512 + 1024
    assert (ceiling.num_full_blocks, ceiling.num_distinct_blocks) == (10, 5)
    assert ceiling.ratio == pytest.approx(2560 / 5484)


def test_bundled_trace_ceiling_matches_the_published_figure() -> None:
    ceiling = reuse_ceiling(load_trace(default_trace_path()))
    assert ceiling.num_requests == 12031
    assert ceiling.prompt_tokens / ceiling.num_requests == pytest.approx(12035, abs=1)
    assert 0.35 < ceiling.ratio < 0.42  # Mooncake (FAST'25) Table 2: about 40%


# ---------------------------------------------------------------------------- GPU cache, pages


def test_gpu_cache_refcounts_lru_eviction_and_duplicates() -> None:
    gpu = GPUPrefixCache(4, evict_clean=True)
    ids = gpu.allocate(3)
    assert ids == [0, 1, 2] and gpu.num_available() == 1
    for block, key in zip(ids, (b"k0", b"k1", b"k2")):
        assert gpu.publish(block, key, is_ready=False)
    assert gpu.match([b"k0", b"k1"]) == (0, True)  # indexed, not ready: wait for it
    gpu.mark_ready(ids)
    assert not gpu.publish(3, b"k0", is_ready=True)  # a key maps to one block
    gpu.release([2, 1, 0])  # tail first: block 2 is the oldest cached
    assert gpu.match([b"k0", b"k1", b"k2", b"k3"]) == (3, False)
    gpu.acquire([0])
    assert gpu.allocate(3) == [3, 2, 1] and gpu.num_evicted == 2
    assert gpu.match([b"k0", b"k1"]) == (1, False) and gpu.allocate(1) is None


def test_gpu_cache_write_on_evict_drains_before_reuse() -> None:
    gpu = GPUPrefixCache(2, evict_clean=False)
    ids = gpu.allocate(2)
    gpu.publish(ids[0], b"a", is_ready=True)
    gpu.release(ids)  # block 0 cached (dirty), block 1 free
    assert gpu.num_available() == 1 and gpu.num_cached == 1
    assert gpu.start_drain(5) == ([0], [b"a"]) and gpu.match([b"a"]) == (0, False)
    assert gpu.num_available() == 1
    gpu.finish_drain([0])
    assert gpu.num_available() == 2


def test_page_fingerprints_catch_poison_wrong_keys_and_torn_pages() -> None:
    pages = PageStore(6, [40, 96], seed=7)
    keys = [private_key(1, i) for i in range(4)]
    pages.write([5, 0, 3, 2], keys)
    assert pages.verify([5, 0, 3, 2], keys) == 0
    assert pages.verify([0, 5], keys[:2]) == 4  # swapped blocks: every page wrong
    pages.tensors[1][3, -1] ^= 0xFF  # tear the tail of one page
    assert pages.verify([3], [keys[2]]) == 1
    pages.poison([2])
    assert pages.verify([2], [keys[3]]) == 2
    with pytest.raises(Exception, match="multiple of 8"):
        PageStore(2, [36])


# ---------------------------------------------------------------------------- end to end


@pytest.mark.parametrize(("policy", "write_policy"), [("lru", "through"), ("arc", "evict")])
def test_trace_slice_end_to_end_keeps_the_invariants(
    mooncake: list[TraceRequest], policy: str, write_policy: str
) -> None:
    requests = mooncake[:250]
    config = SimConfig(
        gpu_tokens=200_000, cpu_tokens=1_500_000, policy=policy, write_policy=write_policy, seed=3
    )
    report = simulate(config, requests)
    _check_invariants(report, len(requests))
    c = report.counters
    assert c["cpu_hit_blocks"] > 0 and report.cpu_evictions > 0 and report.gpu_evictions > 0
    assert 0 < report.hit_ratio < report.ceiling_ratio


def test_offline_optimum_and_reuse_policy_in_the_loop(mooncake: list[TraceRequest]) -> None:
    requests = mooncake[:250]
    reports = {
        policy: simulate(SimConfig(gpu_tokens=200_000, cpu_tokens=600_000, policy=policy), requests)
        for policy in ("lru", "reuse", "opt")
    }
    for report in reports.values():
        _check_invariants(report, len(requests))
    # the optimum is given the future: it bounds the online policies
    assert reports["opt"].hit_ratio > max(reports["lru"].hit_ratio, reports["reuse"].hit_ratio)
    assert reports["opt"].hit_ratio <= reports["opt"].ceiling_ratio
    assert "declined by admission" in str(render_report(reports["reuse"]).columns[1]._cells)


def test_unbounded_capacities_reach_the_trace_ceiling(mooncake: list[TraceRequest]) -> None:
    requests = mooncake[:250]
    ceiling = reuse_ceiling(requests)
    everything = simulate(SimConfig(gpu_tokens=None, cpu_tokens=None), requests)
    assert everything.hit_ratio == ceiling.ratio == everything.gpu_hit_ratio
    for write_policy in ("through", "evict"):  # small GPU: the CPU tier must catch every block
        report = simulate(
            SimConfig(gpu_tokens=200_000, cpu_tokens=None, write_policy=write_policy), requests
        )
        _check_invariants(report, len(requests))
        assert report.cpu_hit_ratio > 0.25 * ceiling.ratio
        assert report.hit_ratio == ceiling.ratio


@pytest.mark.parametrize(
    "overrides",
    [
        dict(cpu_tokens=None),  # tails swapped out and resumed
        dict(cpu_tokens=128),  # no CPU room: tails recomputed
        dict(cpu_tokens=640, write_policy="evict", policy="arc"),
    ],
)
def test_preemption_swaps_tails_out_and_back(overrides: dict[str, Any]) -> None:
    requests = _preempting_trace()
    report = simulate(SimConfig(**{**_TIGHT, **overrides}), requests)
    _check_invariants(report, len(requests))
    c = report.counters
    assert c["preemptions"] > 0 and c["resumes"] == c["preemptions"]
    if overrides["cpu_tokens"] is None:
        assert c["resume_blocks"] == c["preempt_blocks"] > 0 and c["recompute_tokens"] == 0
    if overrides["cpu_tokens"] == 128:
        assert c["preempt_recomputes"] == c["preemptions"] and c["recompute_tokens"] > 0


def test_same_seed_same_report(mooncake: list[TraceRequest]) -> None:
    config = SimConfig(gpu_tokens=150_000, cpu_tokens=500_000, policy="arc")
    first, second = (simulate(config, mooncake[:120]).to_dict(timing=False) for _ in range(2))
    assert first == second
    other = simulate(attrs.evolve(config, seed=1), mooncake[:120]).to_dict(timing=False)
    assert other["settings"].pop("seed") == 1 and first["settings"].pop("seed") == 0
    assert other == first  # the seed changes page bytes, never the schedule


def _truncating_engine() -> ScriptedEngine:
    """Copies loads 8 bytes short: the last word of some pages is never written."""

    def short_loads(_batch_id: int, plan: Any) -> Any:
        if plan.direction is Direction.H2D:
            return attrs.evolve(plan, sizes=np.asarray(plan.sizes) - 8)
        return None

    return ScriptedEngine(HostEngine(), on_submit=short_loads)


def test_a_bad_copy_is_caught_by_the_fingerprints() -> None:
    report = simulate(
        SimConfig(**_TIGHT, cpu_tokens=None), _preempting_trace(), engine=_truncating_engine()
    )
    assert report.page_mismatches > 0


def test_failed_stores_are_counted_and_a_failed_load_stops_the_run() -> None:
    config, requests = SimConfig(**_TIGHT, cpu_tokens=None), _preempting_trace()
    recorder = ScriptedEngine(HostEngine(), record=True)
    clean = simulate(config, requests, engine=recorder)  # the runs are deterministic, so the
    directions = [plan.direction for plan, _, _ in recorder.submitted]  # same batch numbers
    first_store = directions.index(Direction.D2H)  # come again
    first_load = directions.index(Direction.H2D)
    report = simulate(
        config, requests, engine=FaultyEngine(HostEngine(), fail_batches={first_store})
    )
    assert report.counters["store_failed_blocks"] > 0 and report.page_mismatches == 0
    assert report.counters["requests_done"] == clean.counters["requests_done"] == len(requests)
    with pytest.raises(TransferError):
        simulate(config, requests, engine=FaultyEngine(HostEngine(), fail_batches={first_load}))


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        SimConfig(block_size=48)
    with pytest.raises(ConfigError, match="multiple of 8"):
        SimConfig(block_size=2)  # tiny pages would be 8 bytes
    with pytest.raises(ConfigError, match="GiB of pages"):
        simulate(SimConfig(model="llama-3-8b", max_memory_bytes=1 << 30), _SYNTHETIC)


# ---------------------------------------------------------------------------- CLI


def _cli(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


def test_cli_single_run_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert _cli(["--limit", "40", "--cpu-tokens", "2M", "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["counters"]["requests_done"] == 40 and data["counters"]["page_mismatches"] == 0
    assert data["settings"]["cpu_blocks"] == 2_000_000 // 64
    assert "hit ratio" in capsys.readouterr().out


def test_cli_reports_a_malformed_trace_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        ['{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "{oops"],
    )
    assert _cli(["--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: invalid JSON" in err and "Traceback" not in err


def test_cli_sweep_writes_plot_and_table(tmp_path: Path) -> None:
    png, out = tmp_path / "s.png", tmp_path / "s.json"
    argv = [
        "--limit",
        "250",
        "--sweep",
        "64K,8M",
        "--sweep-policies",
        "lru",
        "--gpu-tokens",
        "200K",
        "--plot",
        str(png),
        "--json",
        str(out),
        "--jobs",
        "1",
        "--quiet",
    ]
    assert _cli(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = json.loads(out.read_text())["runs"]
    assert [r["settings"]["cpu_tokens"] for r in runs] == [64_000, 8_000_000]
    assert runs[0]["hit_ratio"] < runs[1]["hit_ratio"] == runs[1]["ceiling_ratio"]


# ---------------------------------------------------------------------------- GPU (lent H200)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["cuda", "kernel", "auto"])
def test_gpu_engines_move_and_verify_real_pages(mooncake: list[TraceRequest], engine: str) -> None:
    for config, requests in (
        (SimConfig(gpu_tokens=200_000, cpu_tokens=1_500_000, engine=engine), mooncake[:250]),
        (SimConfig(**_TIGHT, cpu_tokens=None, engine=engine), _preempting_trace()),
        (
            SimConfig(**_TIGHT, model="qwen2.5-0.5b", cpu_tokens=None, engine=engine),
            _preempting_trace(),
        ),
    ):
        report = simulate(config, requests)
        assert report.settings["engine_used"] == engine
        _check_invariants(report, len(requests))
        assert report.h2d["blocks"] > 0
        host = simulate(attrs.evolve(config, engine="host"), requests)
        assert report.to_dict(timing=False)["counters"] == host.to_dict(timing=False)["counters"]
