"""The vLLM-on-CPU harness itself (tests/vllm_support.py), through vLLM's real scheduler.

These pin what later tests rely on: a prefix stored by A and loaded by B arrives byte for byte,
a corrupted CPU tier is caught by the byte check, preemption and ``reset_prefix_cache`` work,
events come out, and vLLM 0.33 asserts on a failed transfer (the reason kvmgr's own worker
must never report one it cannot settle).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_support import PROMPT, VllmRig, host_config


@pytest.fixture
def rig(tmp_path: Path):
    rig = VllmRig(tmp_path, host_config(), enable_kv_events=True)
    yield rig
    rig.close()


def test_prefix_stored_by_a_is_loaded_by_b(rig: VllmRig) -> None:
    a = rig.add_request(PROMPT)
    rig.run_until_finished()
    assert rig.worker.num_stores == 1
    rig.drop_gpu_prefix_cache()
    b = rig.add_request([*PROMPT, 7, 8])
    rig.run_until_finished()
    assert rig.worker.num_loads == 1
    assert rig.loaded_tokens == {a: 0, b: 64}
    assert rig.mismatched_blocks == []


def test_the_byte_check_catches_a_corrupted_tier(rig: VllmRig) -> None:
    rig.add_request(PROMPT)
    rig.run_until_finished()
    for cpu in rig.worker.cpu:  # damage every stored chunk of the CPU tier
        cpu[:, 8] ^= 0x55
    rig.drop_gpu_prefix_cache()
    b = rig.add_request([*PROMPT, 7, 8])
    rig.run_until_finished()
    assert rig.loaded_tokens[b] == 64
    assert rig.mismatched_blocks == [(b, 0), (b, 1), (b, 2), (b, 3)]


def test_preemption_and_reset(tmp_path: Path) -> None:
    """Eight distinct 48-token prompts growing by 40 tokens on a 24-block GPU cache: vLLM
    preempts (and recomputes or reloads); nothing wrong is loaded."""
    rig = VllmRig(tmp_path, host_config("KvmgrARCPolicy"), num_gpu_blocks=24)
    try:
        prompts = [[100 + 50 * i + t for t in range(48)] for i in range(8)]
        ids = [rig.add_request(p, max_tokens=40) for p in prompts]
        rig.run_until_finished(max_steps=400)
        assert rig.num_preemptions > 0
        assert set(rig.loaded_tokens) == set(ids) and rig.mismatched_blocks == []
        assert rig.manager._policy.chunks  # the CPU tier holds the stored blocks...
        assert rig.scheduler.reset_prefix_cache(reset_connector=True)
        assert rig.manager._policy.chunks == {}  # type: ignore[attr-defined]  # ...not after
    finally:
        rig.close()


def test_events_come_out_of_the_connector(rig: VllmRig) -> None:
    from vllm.distributed.kv_events import BlockStored  # after vllm_support (import warnings)

    rig.add_request(PROMPT)
    rig.run_until_finished()
    events = [e for batch in rig.event_batches for e in batch.events]
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert sum(len(e.block_hashes) for e in stored) == 4  # the connector's: 4 blocks on CPU


def test_vllm_asserts_on_a_failed_transfer(rig: VllmRig) -> None:
    """vLLM 0.33's connector worker has no failure path: ``assert transfer_result.success``."""
    rig.worker.fail_next = 1
    rig.add_request(PROMPT)
    with pytest.raises(AssertionError):
        rig.run_until_finished()


def _kvmgr_rig(tmp_path: Path) -> VllmRig:
    from vllm_support import offload_config

    extra = offload_config(
        "KvmgrOffloadingSpec", "kvmgr.integrations.vllm.backend", kvmgr_engine="host"
    )
    return VllmRig(tmp_path, extra)


def test_a_store_prepared_in_a_step_without_tokens_is_submitted(tmp_path: Path) -> None:
    # A's first prepare_store finds no room (as with a full tier), A finishes in that step; the
    # connector retries at the next schedule, which schedules no token: vLLM's runner still calls
    # wait_for_save, where the connector hands the store to the worker (the rig skipped it: the
    # job stayed in flight for good and run_until_finished never returned)
    rig = _kvmgr_rig(tmp_path)
    try:
        manager, refusals = rig.manager, []
        prepare = manager.prepare_store

        def full_once(keys, req_context):  # type: ignore[no-untyped-def]
            if not refusals:
                refusals.append(list(keys))
                return None
            return prepare(keys, req_context)

        manager.prepare_store = full_once
        rig.add_request(PROMPT)
        rig.run_until_finished(max_steps=50)
        assert refusals and len(manager.tier.index) == 4  # stored at the retry
        rig.drop_gpu_prefix_cache()
        b = rig.add_request([*PROMPT, 7, 8])
        rig.run_until_finished(max_steps=50)
        assert rig.loaded_tokens[b] == 64 and rig.mismatched_blocks == []
    finally:
        rig.close()


def test_blocks_a_store_may_still_read_are_not_poisoned(tmp_path: Path) -> None:
    # vLLM frees a finished request's blocks while its store job is in flight (the connector
    # flushes the job before a block is handed out again); the rig's poison is no allocation,
    # so it must leave those blocks alone, as it leaves blocks of stores not yet built
    rig = _kvmgr_rig(tmp_path)
    try:
        worker = rig.worker
        held: list[object] = []
        finished = worker.get_finished
        worker.get_finished = lambda: held.extend(finished()) or []  # reports held back
        rig.add_request(PROMPT)
        for _ in range(3):
            rig.step()
        side = rig.scheduler.connector.connector_scheduler
        in_flight = sorted(side._block_id_to_pending_jobs)
        assert in_flight and not rig.scheduler.running
        want = [rig.gpu_block(b).copy() for b in in_flight]
        rig.drop_gpu_prefix_cache()
        assert all((rig.gpu_block(b) == w).all() for b, w in zip(in_flight, want, strict=True))
        worker.get_finished = lambda: _drain(held, finished)  # the held reports, then on
        rig.run_until_finished(max_steps=50)
        assert rig.manager.tier.num_pending == 0 and len(rig.manager.tier.index) == 4
    finally:
        rig.close()


def _drain(held: list[object], finished) -> list[object]:  # type: ignore[no-untyped-def]
    out = [*held, *finished()]
    held.clear()
    return out
