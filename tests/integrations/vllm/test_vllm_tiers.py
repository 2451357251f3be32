"""kvmgr's DiskTier and SharedTier as vLLM secondary tiers, through vLLM's tiering manager.

End to end through vLLM's scheduler (`VllmRig` with ``HostTieringOffloadingSpec``): request A's
chunks go GPU -> CPU tier -> kvmgr tier; the CPU tier is reset; B with the same prefix gets them
back kvmgr tier -> CPU -> GPU, compared byte for byte with what A's model wrote. Then the
failures: a corrupted blob (checksum) is a miss and B recomputes; a Redis server killed while
jobs are in flight fails those jobs (vLLM unpins the chunks, lookups say MISS), and the tier
works again once a server is back.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import vllm_support  # noqa: F401  (skips this module without vLLM, fails in CI)
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm_support import PROMPT, VllmRig, host_config

from kvmgr.integrations.vllm.tiers import KvmgrDiskTier, KvmgrSharedTier

MODULE = "kvmgr.integrations.vllm.tiers"


def tiering_config(tier: dict[str, Any], policy: str = "KvmgrLRUPolicy") -> dict[str, Any]:
    tiers = [{"module_path": MODULE, **tier}]
    return host_config(policy, "HostTieringOffloadingSpec", secondary_tiers=tiers)


def disk_tier(tmp_path: Path, **options: Any) -> dict[str, Any]:
    return {"type": "KvmgrDiskTier", "path": str(tmp_path / "kv.slots"), "num_slots": 64, **options}


def store_then_load(rig: VllmRig) -> tuple[str, str]:
    """A computes and stores PROMPT; the GPU cache and the CPU tier are dropped; B reuses it."""
    a = rig.add_request(PROMPT)
    rig.run_until_finished()
    rig.drop_gpu_prefix_cache(reset_connector=True)
    b = rig.add_request([*PROMPT, 7, 8])
    rig.run_until_finished()
    return a, b


@pytest.fixture
def rig_factory(tmp_path: Path):
    rigs: list[VllmRig] = []

    def make(extra: dict[str, Any], **kwargs: Any) -> VllmRig:
        rig = VllmRig(tmp_path / f"rig{len(rigs)}", extra, model_dir=tmp_path / "model", **kwargs)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()
    assert not _regions_left([rig.vllm_config.kv_transfer_config.engine_id for rig in rigs])


def _regions_left(engine_ids: list[str], shm: Path = Path("/dev/shm")) -> list[str]:
    """The files of these engines' offload regions still in ``shm`` (vLLM names them
    ``vllm_offload_{engine_id}.mmap``, then ``.mmap.1``... per segment). Only this test's
    engines: other vLLM test runs on the machine (helpers run the suite at the same time) have
    regions of their own there while they run."""
    mine = tuple(f"vllm_offload_{engine_id}.mmap" for engine_id in engine_ids)
    return sorted(
        name for name in os.listdir(shm) if any(name == m or name.startswith(f"{m}.") for m in mine)
    )


def test_the_region_check_sees_only_this_tests_engines(tmp_path: Path) -> None:
    """Another run's region does not count (the teardown failed on one before, leftovers14);
    this engine's does, and so do its segments."""
    (tmp_path / "vllm_offload_other-run.mmap").touch()
    (tmp_path / "vllm_offload_mine-2.mmap").touch()  # another engine whose id extends mine
    assert _regions_left(["mine"], tmp_path) == []
    (tmp_path / "vllm_offload_mine.mmap.1").touch()
    assert _regions_left(["mine"], tmp_path) == ["vllm_offload_mine.mmap.1"]
    (tmp_path / "vllm_offload_mine.mmap").touch()
    assert _regions_left(["mine"], tmp_path) == [
        "vllm_offload_mine.mmap",
        "vllm_offload_mine.mmap.1",
    ]


@pytest.mark.parametrize("policy", ["KvmgrLRUPolicy", "KvmgrARCPolicy"])
def test_disk_tier_round_trip_through_the_scheduler(
    rig_factory, tmp_path: Path, policy: str
) -> None:
    rig = rig_factory(tiering_config(disk_tier(tmp_path), policy))
    tier = rig.manager.secondary_tiers[0]
    assert isinstance(tier, KvmgrDiskTier)
    a, b = store_then_load(rig)
    stats = tier.statistics()
    assert stats.num_blocks_stored == 4 and stats.num_blocks_loaded == 4
    assert stats.backend.num_hits == 4 and stats.backend.num_corrupt == 0
    assert rig.loaded_tokens == {a: 0, b: 64}
    assert rig.mismatched_blocks == []


def test_corrupt_blob_is_a_miss_and_the_request_recomputes(rig_factory, tmp_path: Path) -> None:
    rig = rig_factory(tiering_config(disk_tier(tmp_path, direct=False)))
    tier = rig.manager.secondary_tiers[0]
    rig.add_request(PROMPT)
    rig.run_until_finished()
    # flip one payload byte of every slot written (block 2's among them)
    slot = tier.backend.slot_bytes
    with open(tmp_path / "kv.slots", "r+b") as f:
        for s in range(4):
            f.seek(s * slot + 100)
            byte = f.read(1)
            f.seek(s * slot + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    rig.drop_gpu_prefix_cache(reset_connector=True)
    b = rig.add_request([*PROMPT, 7, 8])
    rig.run_until_finished()
    stats = tier.statistics()
    assert stats.bridge.num_corrupt >= 1 and stats.num_load_failed >= 1  # (the bridge verifies)
    assert rig.loaded_tokens[b] < 64  # recomputed what did not verify
    assert rig.mismatched_blocks == []  # and nothing wrong was served


def test_shared_tier_round_trip_through_the_scheduler(rig_factory, tier_server) -> None:
    rig = rig_factory(
        tiering_config({"type": "KvmgrSharedTier", "url": tier_server.url, "single_tenant": True})
    )
    tier = rig.manager.secondary_tiers[0]
    assert isinstance(tier, KvmgrSharedTier) and tier.locality.value == "REMOTE"
    a, b = store_then_load(rig)
    assert tier.statistics().num_blocks_loaded == 4
    assert rig.loaded_tokens == {a: 0, b: 64} and rig.mismatched_blocks == []
    assert len(tier_server.command("KEYS", "kvmgr:*")) == 4


def test_shared_tier_seen_by_a_second_instance(rig_factory, tier_server) -> None:
    """Instance 2 never stored the prefix: its lookups ask the server (RETRY, then HIT)."""
    config = tiering_config(
        {"type": "KvmgrSharedTier", "url": tier_server.url, "single_tenant": True}
    )
    first = rig_factory(config)
    first.add_request(PROMPT)
    first.run_until_finished()
    second = rig_factory(config)
    b = second.add_request([*PROMPT, 7, 8])
    second.run_until_finished()
    assert second.loaded_tokens[b] == 64 and second.mismatched_blocks == []


# -- a server killed with jobs in flight, through vLLM's tiering manager directly ----------------


def _store(manager: Any, req_id: str, names: list[str]) -> tuple[list[bytes], ReqContext]:
    keys = [make_offload_key(n.encode(), 0) for n in names]
    ctx = ReqContext(req_id=req_id)
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * 16)
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    view = manager.primary_tier.get_kv_memoryview()
    rows = np.asarray(view).view(np.uint8)
    rng = np.random.default_rng(len(req_id))
    for chunk in out.store_spec.chunk_ids:
        rows[chunk] = rng.integers(1, 256, rows.shape[1], dtype=np.uint8)
    return keys, ctx


def _settle(manager: Any, tier: Any, timeout_s: float = 10.0) -> None:
    """Step the manager's end-of-step hook until the tier has no job in flight."""
    deadline = time.monotonic() + timeout_s
    while tier.has_pending_work() or manager.has_pending_work():
        assert time.monotonic() < deadline, "tier jobs did not finish"
        manager.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(0.01)
    manager.on_schedule_end(ScheduleEndContext((), ()))


def test_server_killed_mid_job(rig_factory, tier_server) -> None:
    rig = rig_factory(
        tiering_config(
            {
                "type": "KvmgrSharedTier",
                "url": tier_server.url,
                "deadline_s": 0.5,
                "single_tenant": True,
            }
        )
    )
    manager, tier = rig.manager, rig.manager.secondary_tiers[0]
    primary = manager.primary_tier

    # 1. a cascade (store) job in flight when the server dies: the server is frozen first, so
    #    the job is waiting on its reply, then killed
    keys, ctx = _store(manager, "r1", ["a0", "a1", "a2"])
    tier_server.process.send_signal(signal.SIGSTOP)
    manager.complete_store(keys, ctx)  # submits the cascade job
    assert tier.has_pending_work()
    time.sleep(0.05)
    tier_server.kill()
    _settle(manager, tier)
    stats = tier.statistics()
    assert stats.num_store_failed == 1 and stats.num_blocks_stored == 0
    assert stats.backend.num_errors + stats.backend.num_timeouts >= 1
    # vLLM unpinned the chunks: they are ready, readable and evictable again
    assert all(primary._policy.get(k).ref_cnt == 0 for k in keys)
    manager.on_request_finished(ctx)

    # 2. with a server back, stores land (after SharedTier's reconnect back-off, during which
    #    calls fail fast); then a promotion (load) job in flight when it dies
    tier_server.start()
    time.sleep(0.3)
    keys, ctx = _store(manager, "r2", ["b0", "b1"])
    manager.complete_store(keys, ctx)
    _settle(manager, tier)
    assert tier.statistics().num_blocks_stored == 2
    manager.on_request_finished(ctx)
    manager.reset_cache()  # the CPU tier forgets b0, b1; the shared tier keeps them
    manager.on_reset_flushed()
    ctx = ReqContext(req_id="r3")
    manager.on_new_request(ctx)
    assert manager.lookup(keys[0], ctx) is LookupResult.HIT_PENDING  # promotion queued
    tier_server.process.send_signal(signal.SIGSTOP)
    manager.on_schedule_end(ScheduleEndContext((), ()))  # submits the load job
    assert tier.has_pending_work()
    time.sleep(0.05)
    tier_server.kill()
    _settle(manager, tier)
    assert tier.statistics().num_load_failed == 1
    # the failed promotion freed its chunk, and the key is not promised again: MISS, not RETRY
    assert manager.lookup(keys[0], ctx) is LookupResult.MISS
    manager.on_request_finished(ctx)

    # 3. nothing wrong was left behind: a fresh server, a fresh store works
    tier_server.start()
    time.sleep(0.3)
    keys, ctx = _store(manager, "r4", ["c0"])
    manager.complete_store(keys, ctx)
    _settle(manager, tier)
    assert tier.statistics().num_blocks_stored == 3
    manager.on_request_finished(ctx)


def test_disk_tier_sizes_and_bad_options(rig_factory, tmp_path: Path) -> None:
    from kvmgr.errors import ConfigError

    slot = 12288  # one 8 KiB chunk + the 48-byte header, rounded up to 4 KiB
    rig = rig_factory(
        tiering_config(
            {"type": "KvmgrDiskTier", "path": str(tmp_path / "a"), "capacity_bytes": 10 * slot}
        )
    )
    tier = rig.manager.secondary_tiers[0]
    assert (tier.backend.slot_bytes, tier.backend.num_slots) == (slot, 10)
    assert tier.medium.value == "STORAGE" and tier.locality.value == "LOCAL"
    with pytest.raises(ConfigError, match="exactly one of num_slots and capacity_bytes"):
        rig_factory(tiering_config({"type": "KvmgrDiskTier", "path": str(tmp_path / "b")}))


def test_tier_options_are_checked_before_anything_starts() -> None:
    """A tier's own options are checked first: no vLLM spec is read, no loop thread starts."""
    from kvmgr.integrations.vllm.tiers import KvmgrTierManager

    vllm_args = {"offloading_spec": None, "primary_kv_view": memoryview(b""), "tier_type": "t"}
    with pytest.raises(TypeError, match="unexpected options \\['bogus'\\]"):
        KvmgrTierManager(**vllm_args, bogus=1)
    with pytest.raises(TypeError, match="url"):
        KvmgrSharedTier(**vllm_args)
    with pytest.raises(TypeError, match="path"):
        KvmgrDiskTier(**vllm_args, num_slots=4)


def _job(job_id: int, names: list[str], chunk_ids: list[int], *, load: bool = False) -> Any:
    from vllm.v1.kv_offload.tiering.base import TransferJob

    keys = [make_offload_key(n.encode(), 0) for n in names]
    ids = np.array(chunk_ids, dtype=np.int32)  # as vLLM's tiering manager builds them
    return TransferJob(job_id, keys, ids, load, ReqContext(req_id=f"r{job_id}"))


def test_a_job_breaking_vllms_chunk_contract_is_refused_at_submit(rig_factory, tmp_path) -> None:
    """vLLM promises valid, pinned primary-tier slots (``SecondaryTierManager.submit_store``).
    A store with a chunk id out of range ran as a job and came back ``success=False`` (a
    "failed store", counted, its error logged as a crash); now ``submit_store`` /
    ``submit_load`` raise a typed error before anything is counted or runs (leftovers14)."""
    from kvmgr.errors import InvalidBlockError, InvalidKeyError

    rig = rig_factory(tiering_config(disk_tier(tmp_path)))
    tier = rig.manager.secondary_tiers[0]
    num_chunks = np.asarray(rig.manager.primary_tier.get_kv_memoryview()).shape[0]
    before = tier.statistics()
    bad = {
        "store-past": (InvalidBlockError, "out of range", _job(901, ["a"], [num_chunks + 3])),
        "store-negative": (InvalidBlockError, "out of range", _job(902, ["a", "b"], [0, -1])),
        "store-lengths": (InvalidBlockError, "2 chunk ids for 1 keys", _job(903, ["a"], [0, 1])),
        "store-twice": (InvalidBlockError, "twice", _job(904, ["a", "b"], [2, 2])),
        "store-keys": (InvalidKeyError, "distinct", _job(905, ["a", "a"], [2, 3])),
        "load-past": (InvalidBlockError, "out of range", _job(906, ["a"], [num_chunks], load=True)),
        "load-twice": (InvalidBlockError, "twice", _job(907, ["a", "b"], [1, 1], load=True)),
    }
    for name, (error, match, job) in bad.items():
        submit = tier.submit_load if job.is_promotion else tier.submit_store
        with pytest.raises(error, match=match):
            submit(job)
        assert not tier.has_pending_work(), name  # nothing runs, nothing to report
    assert tier.statistics() == before  # nothing counted
    # the tier goes on: a good job of the same keys runs
    tier.submit_store(_job(908, ["a", "b"], [0, 1]))
    deadline = time.monotonic() + 10
    results: list[Any] = []
    while not results and time.monotonic() < deadline:
        time.sleep(0.01)
        results = list(tier.get_finished_jobs())
    assert [(r.job_id, r.success) for r in results] == [(908, True)]
