"""The hybrid simulation (kvmgr.sim.hybrid) and ``kvmgr simulate-hybrid``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmgr.cli import main
from kvmgr.errors import ConfigError
from kvmgr.sim.hybrid import HybridSimConfig, simulate_hybrid
from kvmgr.sim.hybrid_presets import HYBRID_PRESETS, get_hybrid
from kvmgr.sim.trace import default_trace_path, load_trace

TRACE = load_trace(default_trace_path(), limit=120)


def test_unbounded_budget_groups_hit_as_often_and_move_only_live_blocks() -> None:
    # nothing is evicted: the restorable boundaries are the same, the loads are not
    config = HybridSimConfig(
        preset="gpt-oss-20b", block_size=128, cpu_bytes=2**41, variants=("full", "all")
    )  # 2 TiB: more than the 120 requests store
    full, groups = simulate_hybrid(config, TRACE)
    assert full.hit_tokens == groups.hit_tokens > 0 and full.num_hits == groups.num_hits
    layout = get_hybrid("gpt-oss-20b").layout(128)
    full_block, swa_block = (g.block_bytes for g in layout.groups)
    # full attention layers load every block, the 128-token window one block per hit
    assert (
        groups.bytes_loaded == groups.hit_tokens // 128 * full_block + groups.num_hits * swa_block
    )
    assert full.bytes_loaded == full.hit_tokens // 128 * (full_block + swa_block)
    assert groups.bytes_per_hit < full.bytes_per_hit
    assert groups.orphans_dropped == 0 and groups.stores_rejected == 0


def test_tail_stores_only_the_last_window_and_state() -> None:
    config = HybridSimConfig(preset="qwen3-next-80b", cpu_bytes=2**41, variants=("all", "tail"))
    every, tail = simulate_hybrid(config, TRACE)
    layout = get_hybrid("qwen3-next-80b").layout(512)
    full_block, state = (g.block_bytes for g in layout.groups)
    assert every.bytes_stored > tail.bytes_stored
    # a tail hit loads one state, like every other hit; it may hit less often (only the
    # boundaries where some request ended can be restored)
    assert tail.bytes_loaded == tail.hit_tokens // 512 * full_block + tail.num_hits * state
    assert tail.hit_tokens <= every.hit_tokens


def test_bounded_budget_drops_orphans_and_keeps_loads_restorable() -> None:
    config = HybridSimConfig(preset="gemma-3-27b", cpu_bytes=8 * 2**30, variants=("all",))
    (result,) = simulate_hybrid(config, TRACE)
    assert (
        result.orphans_dropped > 0
    )  # the groups evicted different blocks: no memory kept for them
    assert result.num_hits > 0


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError):
        HybridSimConfig(preset="nope")
    with pytest.raises(ConfigError):
        HybridSimConfig(block_size=100)
    with pytest.raises(ConfigError):
        HybridSimConfig(variants=("full", "half"))
    with pytest.raises(ConfigError):
        HybridSimConfig(policy="nope")
    assert set(HYBRID_PRESETS) >= {"gpt-oss-120b", "gemma-3-27b", "qwen3-next-80b"}


def test_cli_writes_the_figures(tmp_path: Path) -> None:
    out = tmp_path / "h.json"
    argv = ["simulate-hybrid", "--limit", "40", "--cpu-gib", "16", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert [r["variant"] for r in data["budgets"][0]["runs"]] == ["full", "all", "tail"]
    assert main(["simulate-hybrid", "--variants", "half"]) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cpu-gib", "inf"], "--cpu-gib: expected finite budgets > 0"),
        (["--cpu-gib", "nan"], "--cpu-gib: expected finite budgets > 0"),
        (["--cpu-gib", ","], "--cpu-gib: expected finite budgets > 0"),
        (["--cpu-gib", "0"], "--cpu-gib: expected finite budgets > 0"),
        (["--json", "/nonexistent-kvmgr-dir/x.json"], "--json: no directory"),
    ],
)
def test_cli_refuses_bad_budgets_and_outputs_before_running(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Session 14 (newuser16): ``--cpu-gib inf`` / ``nan`` crashed with a traceback, ``,`` ran
    nothing and exited 0, and a ``--json`` path in a missing folder crashed after the run."""
    assert main(["simulate-hybrid", "--limit", "5", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
