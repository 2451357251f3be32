"""``kvmgr simulate --instances N --shared URL``: several instances sharing a real server.

The shared tier runs on a real Valkey/Redis server (tests/tiers_server.py; skipped without the
binary locally, never in CI). Pages fetched from the shared tier are verified by the
simulator's fingerprints like every other load.
"""

from __future__ import annotations

import asyncio

from kvmgr.sim.loop import SimConfig
from kvmgr.sim.multi import run_instances
from kvmgr.sim.trace import bundled_trace_path, load_trace


def _requests(n: int):
    return load_trace(bundled_trace_path("mooncake-conversation"), limit=n)


def test_sharing_a_tier_adds_hits_and_serves_the_right_pages(tier_server) -> None:
    requests = _requests(300)
    config = SimConfig(gpu_tokens=250_000, cpu_tokens=1_000_000)
    local = asyncio.run(run_instances(config, requests, num_instances=3, route="round-robin"))
    shared = asyncio.run(
        run_instances(
            config, requests, num_instances=3, route="round-robin", shared_url=tier_server.url
        )
    )
    assert local.page_mismatches == 0 and shared.page_mismatches == 0
    assert local.lower_hit_ratio == 0 and local.fetched_blocks == 0
    assert shared.fetched_blocks > 0 and shared.tier_bytes_written > 0
    assert shared.hit_ratio > local.hit_ratio  # round-robin splits conversations: sharing pays
    assert sum(i.counters["pages_verified"] for i in shared.instances) > 0


def test_one_instance_without_tiers_matches_the_single_simulator() -> None:
    from kvmgr.sim.loop import simulate

    requests = _requests(200)
    config = SimConfig(gpu_tokens=250_000, cpu_tokens=1_000_000)
    multi = asyncio.run(run_instances(config, requests, num_instances=1))
    single = simulate(config, requests)
    assert multi.instances[0].hit_ratio == single.hit_ratio


def test_disk_tier_per_instance(tmp_path) -> None:
    requests = _requests(200)
    config = SimConfig(gpu_tokens=100_000, cpu_tokens=200_000)
    report = asyncio.run(
        run_instances(
            config, requests, num_instances=2, disk_path=str(tmp_path), disk_tokens=4_000_000
        )
    )
    assert report.page_mismatches == 0
    assert report.tier_bytes_written > 0  # CPU evictions were written back to disk
