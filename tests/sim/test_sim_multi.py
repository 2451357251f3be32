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


def test_disk_tier_runs_are_cold_deterministic_and_leave_no_files(tmp_path) -> None:
    """Issue 20: a second run with the same --disk folder started warm (above the trace's
    ceiling), runs on fresh folders differed (tier writes raced later fetches), and every
    run left its preallocated files behind."""
    from kvmgr.sim.multi import disk_file

    requests = _requests(300)
    config = SimConfig(gpu_tokens=100_000, cpu_tokens=150_000)

    def run(folder) -> dict[str, object]:
        report = asyncio.run(
            run_instances(
                config, requests, num_instances=2, disk_path=str(folder), disk_tokens=1_000_000
            )
        )
        assert report.page_mismatches == 0 and report.fetched_blocks > 0
        assert list(folder.iterdir()) == []  # scratch files deleted
        return {
            "hit": report.hit_ratio,
            "lower": report.lower_hit_ratio,
            "fetched": report.fetched_blocks,
            "read": report.tier_bytes_read,
            "per_instance": [i.hit_ratio for i in report.instances],
        }

    first = run(tmp_path)
    (tmp_path / "other").mkdir()
    disk_file(tmp_path / "other", 0).write_bytes(b"x" * 4096)  # a crashed run's file
    again = run(tmp_path / "other")
    assert again == first  # same folder or a fresh one: the same cold, deterministic run


def test_simulate_refuses_a_wrong_password_at_once(tier_server_factory, capsys) -> None:
    """Issue 20: a wrong password ran the whole replay (only a log line), reading
    "unreachable"; now one lookup before the run ends the command with the server's reason."""
    from kvmgr import cli

    server = tier_server_factory("--requirepass", "right", admin={"password": "right"})
    url = f"redis://:wrong@127.0.0.1:{server.port}"
    assert cli.main(["simulate", "--quiet", "--limit", "5", "--shared", url]) == 2
    err = capsys.readouterr().err
    assert "--shared: the server cannot be used" in err and "WRONGPASS" in err
    assert "wrong" not in err.replace("WRONGPASS", "")  # the password is never printed
