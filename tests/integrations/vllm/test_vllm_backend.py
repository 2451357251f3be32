"""kvmgr's whole offloading backend (``KvmgrOffloadingSpec``) end to end inside vLLM 0.33 on CPU.

vLLM's real ``Scheduler`` and both sides of its ``OffloadingConnector`` load kvmgr's spec out of
tree (``spec_module_path``); the worker copies with kvmgr's host engine between the CPU
"GPU" caches and its own CPU tier; a fake model writes KV as a function of the token prefix, so
every loaded block is compared byte for byte (tests/vllm_support.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from vllm_support import PROMPT, VllmRig, offload_config

from kvmgr.errors import TransferError
from kvmgr.testing import FaultyEngine


def backend_config(policy: str = "lru", **extra: object) -> dict[str, object]:
    return offload_config(
        "KvmgrOffloadingSpec",
        "kvmgr.integrations.vllm.backend",
        kvmgr_policy=policy,
        kvmgr_engine="host",
        **extra,
    )


@pytest.fixture
def rig(tmp_path: Path):
    rig = VllmRig(tmp_path, backend_config(), enable_kv_events=True)
    yield rig
    rig.close()


def _stored_rows(rig: VllmRig, keys: list[bytes]) -> np.ndarray:
    """float32 bytes of the CPU tier's chunks under ``keys``, ``[len(keys), layers, ...]``."""
    ids = [rig.manager.tier.index[k] for k in keys]
    return np.stack(
        [np.stack([v[i].numpy().view(np.float32) for v in rig.worker.cpu_views]) for i in ids]
    )


def test_kvmgr_spec_is_what_vllm_loaded(rig: VllmRig) -> None:
    from kvmgr.integrations.vllm.backend import KvmgrOffloadingManager, KvmgrOffloadingWorker

    assert isinstance(rig.manager, KvmgrOffloadingManager)
    assert isinstance(rig.worker, KvmgrOffloadingWorker)
    assert rig.worker.engine.name == "host"
    # 1 MiB over one rank's 2 layers x 2 KiB per block
    assert rig.manager.num_chunks == (1 << 20) // (2 * 2 * 16 * 32 * 4)


def test_a_stores_b_loads_the_same_bytes(rig: VllmRig) -> None:
    # A computes 4 blocks; the connector stores them in one job, one D2H batch
    a = rig.add_request(PROMPT)
    rig.run_until_finished()
    stats = rig.worker.statistics()
    assert (stats.num_store_jobs, stats.num_store_batches) == (1, 1)
    keys = list(rig.manager.tier.index)
    assert len(keys) == 4
    # the CPU tier holds exactly what A's model wrote, block by block
    want = np.stack([rig.expected_block(PROMPT, i) for i in range(4)])
    assert np.array_equal(_stored_rows(rig, keys).reshape(want.shape), want)
    # B shares A's prefix; the GPU prefix cache is dropped and poisoned, so B must load
    rig.drop_gpu_prefix_cache()
    b = rig.add_request([*PROMPT, 7, 8])
    rig.run_until_finished()
    assert rig.worker.statistics().num_load_batches == 1
    assert rig.loaded_tokens == {a: 0, b: 64}
    assert rig.mismatched_blocks == []
    assert rig.manager.tier.num_loading == 0  # complete_load let go of every chunk


def test_jobs_of_one_step_become_one_batch_per_direction(rig: VllmRig) -> None:
    prompts = [[500 + 100 * r + t for t in range(48)] for r in range(4)]
    for p in prompts:  # four requests scheduled together: four store jobs in one step
        rig.add_request(p)
    rig.run_until_finished()
    stats = rig.worker.statistics()
    assert (stats.num_store_jobs, stats.num_store_batches) == (4, 1)
    rig.drop_gpu_prefix_cache()
    ids = [rig.add_request([*p, 9]) for p in prompts]  # four loads in one step
    rig.run_until_finished()
    stats = rig.worker.statistics()
    assert (stats.num_load_jobs, stats.num_load_batches) == (4, 1)
    assert all(rig.loaded_tokens[i] == 48 for i in ids) and rig.mismatched_blocks == []


def test_expedited_loads_go_first_in_their_own_batch(tmp_path: Path) -> None:
    rig = VllmRig(tmp_path, backend_config(sync_load_budget_bytes=1 << 30))
    try:
        rig.add_request(PROMPT)
        rig.run_until_finished()
        rig.drop_gpu_prefix_cache()
        b = rig.add_request([*PROMPT, 7, 8])
        rig.run_until_finished()
        assert rig.loaded_tokens[b] == 64 and rig.mismatched_blocks == []
        assert rig.worker.statistics().num_load_batches == 1
    finally:
        rig.close()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_preemption_eviction_and_reset(tmp_path: Path, policy: str) -> None:
    """Eight 48-token prompts growing by 40 tokens on a 24-block GPU cache and a 16-chunk CPU
    tier: vLLM preempts and reloads, kvmgr evicts; nothing wrong is ever loaded."""
    rig = VllmRig(tmp_path, backend_config(policy, cpu_bytes_to_use=16 * 8192), num_gpu_blocks=24)
    try:
        assert rig.manager.num_chunks == 16
        prompts = [[100 + 50 * i + t for t in range(48)] for i in range(8)]
        ids = [rig.add_request(p, max_tokens=40) for p in prompts]
        rig.run_until_finished(max_steps=400)
        assert rig.num_preemptions > 0
        assert set(rig.loaded_tokens) == set(ids) and rig.mismatched_blocks == []
        assert rig.manager.tier.counters.evictions > 0
        assert len(rig.manager.tier.index) == 16
        # reset_prefix_cache(reset_connector=True) empties kvmgr's tier too
        assert rig.scheduler.reset_prefix_cache(reset_connector=True)
        assert rig.manager.tier.index == {}
        assert rig.manager.tier.pool.num_free == 16  # nothing in flight: every chunk is free
        # ... and the tier works again afterwards: C stores, D loads
        rig.add_request(prompts[0])
        rig.run_until_finished()
        rig.drop_gpu_prefix_cache()
        d = rig.add_request([*prompts[0], 3])
        rig.run_until_finished()
        assert rig.loaded_tokens[d] == 48 and rig.mismatched_blocks == []
    finally:
        rig.close()


def test_events_stored_and_evicted(tmp_path: Path) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    rig = VllmRig(tmp_path, backend_config(cpu_bytes_to_use=4 * 8192), enable_kv_events=True)
    try:
        rig.add_request(PROMPT)  # fills the 4-chunk tier
        rig.run_until_finished()
        rig.add_request([900 + t for t in range(32)])  # 2 more: evicts A's 2 leaves
        rig.run_until_finished()
        events = [e for batch in rig.event_batches for e in batch.events]
        stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
        removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
        assert sum(len(e.block_hashes) for e in stored) == 6
        assert sum(len(e.block_hashes) for e in removed) == 2
        # prefix consistency: A's root blocks stayed
        rig.drop_gpu_prefix_cache()
        b = rig.add_request([*PROMPT[:32], 1])
        rig.run_until_finished()
        assert rig.loaded_tokens[b] == 32 and rig.mismatched_blocks == []
    finally:
        rig.close()


def test_a_failed_store_is_never_served(rig: VllmRig) -> None:
    # the worker's first batch (A's store) copies, then fails; FaultyEngine poisons its chunks
    rig.worker.engine = FaultyEngine(rig.worker.engine, fail_batches={0})
    rig.add_request(PROMPT)
    rig.run_until_finished()  # vLLM saw a finished job (its assert holds)...
    assert rig.worker.statistics().num_failed_store_jobs == 1
    assert rig.manager.tier.index == {}  # ...kvmgr dropped the chunks instead of READY
    assert rig.manager.tier.pool.num_free == rig.manager.num_chunks
    # B with the same prefix finds nothing and computes its blocks itself
    rig.drop_gpu_prefix_cache()
    b = rig.add_request([*PROMPT, 7, 8])
    rig.run_until_finished()
    assert rig.loaded_tokens[b] == 0 and rig.mismatched_blocks == []
    # the next store of the same prefix lands (B stored it) and C loads it
    rig.drop_gpu_prefix_cache()
    c = rig.add_request([*PROMPT, 5])
    rig.run_until_finished()
    assert rig.loaded_tokens[c] == 64 and rig.mismatched_blocks == []


def test_a_failed_load_raises_under_vllms_connector(rig: VllmRig) -> None:
    rig.add_request(PROMPT)
    rig.run_until_finished()
    batches = rig.worker.statistics().num_store_batches
    rig.worker.engine = FaultyEngine(rig.worker.engine, fail_batches={0}, poison=False)
    assert batches == 1
    rig.drop_gpu_prefix_cache()
    rig.add_request([*PROMPT, 7, 8])
    with pytest.raises(TransferError, match="KvmgrOffloadingConnector"):
        rig.run_until_finished()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_is_reported_under_kvmgrs_connector(tmp_path: Path, policy: str) -> None:
    """With ``KvmgrOffloadingConnector`` the failed load's GPU blocks reach vLLM as load
    errors: it takes them back (``recompute``: asks the connector again, which loads them
    again, and this time the copy succeeds) or fails the request (``fail``), its
    ``kv_load_failure_policy``."""
    from kvmgr.integrations.vllm.backend import KvmgrOffloadingConnector

    rig = VllmRig(
        tmp_path,
        backend_config(),
        connector_cls=KvmgrOffloadingConnector,
        kv_load_failure_policy=policy,
    )
    try:
        rig.add_request(PROMPT)
        rig.run_until_finished()
        rig.worker.engine = FaultyEngine(rig.worker.engine, fail_batches={0}, poison=False)
        rig.drop_gpu_prefix_cache()
        b = rig.add_request([*PROMPT, 7, 8])
        rig.run_until_finished()
        assert rig.worker.statistics().num_failed_load_jobs == 1
        assert b not in rig.scheduler.requests  # the request ended either way
        if policy == "recompute":  # it ran on the second load's blocks
            assert rig.worker.statistics().num_load_jobs == 2
            assert rig.loaded_tokens[b] == 64
        else:  # it never ran on the blocks the load wrote
            assert b not in rig.loaded_tokens
        assert rig.mismatched_blocks == []
        assert rig.manager.tier.num_loading == 0
    finally:
        rig.close()


def test_chunks_of_two_blocks_with_an_unaligned_gpu_prefix(tmp_path: Path) -> None:
    """``blocks_per_chunk=2``: B's first block is already in the GPU prefix cache, so its load
    starts in the middle of a chunk (``block_indices`` not a multiple of the chunk)."""
    rig = VllmRig(tmp_path, backend_config(blocks_per_chunk=2))
    try:
        prompt = list(range(20, 116))  # 6 blocks = 3 chunks
        rig.add_request(prompt)
        rig.run_until_finished()
        assert len(rig.manager.tier.index) == 3
        rig.drop_gpu_prefix_cache()
        d = rig.add_request(prompt[:24])  # 1.5 blocks: no whole chunk to load, computes block 0
        rig.run_until_finished()
        assert rig.loaded_tokens[d] == 0
        specs = []
        submit_load = rig.worker.submit_load

        def recording_submit_load(job_id, src_spec, dst_spec, expedited=False):
            specs.append((list(dst_spec.block_indices), list(src_spec.block_ids)))
            return submit_load(job_id, src_spec, dst_spec, expedited)

        rig.worker.submit_load = recording_submit_load
        b = rig.add_request([*prompt, 7, 8])
        rig.run_until_finished()
        assert rig.loaded_tokens[b] == 96  # 1 block from the GPU cache, 5 loaded
        assert [(first, len(chunks)) for first, chunks in specs] == [([1], 3)]
        assert rig.mismatched_blocks == []
    finally:
        rig.close()
