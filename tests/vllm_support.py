"""vLLM 0.33 on CPU, for tests: the real scheduler and ``OffloadingConnector``, a worker driven by hand.

What it builds (no GPU, no weights, no network):

- a tiny Llama ``config.json`` (`write_tiny_llama`) and from it a ``VllmConfig``
  (`make_vllm_config`: ``HF_HUB_OFFLINE=1``, ``skip_tokenizer_init=True``, CPU device config,
  ``OffloadingConnector`` in ``kv_both`` with the given ``kv_connector_extra_config``);
- `VllmRig`: vLLM's real ``Scheduler`` (with the ``OffloadingConnector`` on its scheduler side,
  whose spec vLLM loads through ``spec_name`` / ``spec_module_path``) and the connector's worker
  side, with CPU tensors as the "GPU" KV caches (one float32 ``[num_blocks, heads, block_size,
  2 * head_dim]`` tensor per layer). ``step()`` runs one engine step: schedule, the worker's
  ``handle_preemptions`` / ``start_load_kv`` / ``wait_for_save`` / ``get_finished``, a fake
  model that writes each computed token's KV as a function of the token prefix
  (`VllmRig.expected_block`), and ``update_from_output``;
- two out-of-tree specs for vLLM's own managers (in tests/vllm_host.py, re-exported here, so
  loadable with ``spec_module_path="vllm_support"``): `HostCPUOffloadingSpec` (vLLM's ``CPUOffloadingManager``,
  any ``eviction_policy``) and `HostTieringOffloadingSpec` (vLLM's ``TieringOffloadingManager``
  with ``secondary_tiers``). Their worker, `HostOffloadingWorker`, copies pages between the
  CPU "GPU" caches and the CPU tier with torch indexing (vLLM's own worker needs CUDA); it can
  be told to fail jobs (`HostOffloadingWorker.fail_next`).

Example (a kvmgr policy inside vLLM's CPU manager, a prefix stored then loaded)::

    rig = VllmRig(tmp_path, {"spec_name": "HostCPUOffloadingSpec",
                             "spec_module_path": "vllm_support",
                             "cpu_bytes_to_use": 1 << 20,
                             "eviction_policy": "KvmgrLRUPolicy",
                             "cache_policy_module_path": "kvmgr.integrations.vllm.policies"})
    a = rig.add_request(list(range(64)))          # 4 full blocks of 16 tokens
    rig.run_until_finished()                      # computes, stores its blocks
    rig.drop_gpu_prefix_cache()                   # B must load from the CPU tier
    b = rig.add_request(list(range(64)) + [7, 8])
    rig.run_until_finished()
    assert rig.loaded_tokens[b] == 64 and rig.mismatched_blocks == []
    rig.close()

Another spec (kvmgr's own, issue 22 part 3) plugs in through ``extra_config`` the same way. The
first vLLM import takes ~15 s; import this module lazily (inside fixtures) in test files that
also hold fast tests.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm_host import (  # first: skips without vLLM (fails in CI), sets HF_HUB_OFFLINE
    HostCPUOffloadingSpec,
    HostOffloadingWorker,
    HostTieringOffloadingSpec,
)

# vLLM and the torch modules it pulls in warn at import time (deprecations outside kvmgr);
# the suite turns warnings into errors, so the imports run with warnings ignored.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from vllm import SamplingParams
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.forward_context import ForwardContext
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

__all__ = [
    "HostCPUOffloadingSpec",
    "HostOffloadingWorker",
    "HostTieringOffloadingSpec",
    "VllmRig",
    "make_vllm_config",
    "write_tiny_llama",
]

NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 16
EOS_TOKEN_ID = 2
VOCAB_SIZE = 1024

PROMPT = list(range(10, 74))  # 64 tokens: 4 full blocks of 16
POLICIES = "kvmgr.integrations.vllm.policies"


def offload_config(spec_name: str, spec_module_path: str, **settings: Any) -> dict[str, Any]:
    """The connector's extra config for the out-of-tree offloading spec ``spec_name`` of module
    ``spec_module_path``, with a 1 MiB CPU tier unless ``settings`` say ``cpu_bytes_to_use``."""
    return {
        "spec_name": spec_name,
        "spec_module_path": spec_module_path,
        "cpu_bytes_to_use": 1 << 20,
        **settings,
    }


def host_config(
    policy: str = "KvmgrLRUPolicy", spec_name: str = "HostCPUOffloadingSpec", **settings: Any
) -> dict[str, Any]:
    """``offload_config`` for one of this module's specs of vLLM's own managers, with the kvmgr
    policy ``policy`` (a class name in kvmgr.integrations.vllm.policies)."""
    return offload_config(
        spec_name,
        "vllm_support",
        eviction_policy=policy,
        cache_policy_module_path=POLICIES,
        **settings,
    )


def write_tiny_llama(directory: Path) -> Path:
    """Write a tiny Llama ``config.json`` (2 layers, 2 KV heads of 16, fp32) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": NUM_LAYERS,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": EOS_TOKEN_ID,
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def make_vllm_config(
    model_dir: Path,
    extra_config: dict[str, Any],
    *,
    block_size: int = 16,
    num_gpu_blocks: int = 64,
    max_num_batched_tokens: int = 512,
    max_model_len: int = 2048,
    enable_kv_events: bool = False,
    connector: str = "OffloadingConnector",
    connector_module_path: str | None = None,
    kv_load_failure_policy: str = "fail",
) -> VllmConfig:
    """A CPU ``VllmConfig`` with the ``OffloadingConnector`` (or ``connector``, loaded from
    ``connector_module_path``; ``kv_both``) and ``extra_config``."""
    from vllm.config import KVEventsConfig

    model = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=max_model_len,
        seed=0,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_gpu_blocks
    scheduler = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    kv_transfer = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=connector_module_path,
        kv_load_failure_policy=kv_load_failure_policy,
        kv_role="kv_both",
        kv_connector_extra_config=dict(extra_config),
    )
    events = (
        KVEventsConfig(enable_kv_cache_events=True, publisher="null") if enable_kv_events else None
    )
    return VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=scheduler,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer,
        kv_events_config=events,
    )


class _RecordingPublisher:
    """Stands in for vLLM's event publisher: appends every published ``KVEventBatch``."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def publish(self, events: Any) -> None:
        self.batches.append(events)

    def shutdown(self) -> None:
        return


def _token_rows(token_ids: Sequence[int], start: int, stop: int) -> np.ndarray:
    """float32 ``[stop - start, layers, heads, 2 * head_dim]``: the KV the fake model writes for
    tokens ``start..stop`` (a function of the whole prefix up to each token, never zero)."""
    digest = hashlib.blake2b(digest_size=8)
    seeds = []
    for t, tok in enumerate(token_ids[:stop]):
        digest.update(int(tok).to_bytes(4, "little"))
        if t >= start:
            seeds.append(int.from_bytes(digest.copy().digest(), "little"))
    width = NUM_LAYERS * NUM_KV_HEADS * 2 * HEAD_DIM
    lanes = np.arange(1, width + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    mixed = (np.array(seeds, dtype=np.uint64)[:, None] ^ lanes) >> np.uint64(40)
    values = mixed.astype(np.float32) / np.float32(1 << 24) + np.float32(0.5)
    return values.reshape(len(seeds), NUM_LAYERS, NUM_KV_HEADS, 2 * HEAD_DIM)


class VllmRig:
    """vLLM's scheduler + ``OffloadingConnector`` (both sides) on CPU, one step at a time.

    Args:
        directory: where the tiny model's ``config.json`` goes.
        extra_config: ``kv_connector_extra_config`` (``spec_name``, ``spec_module_path``, ...).
        num_gpu_blocks: blocks of the "GPU" KV cache (tokens = blocks x ``block_size``).
        block_size: tokens per GPU block.
        enable_kv_events: turn on vLLM's KV cache events (kept in `event_batches`).
        model_dir: where to write the model's ``config.json`` (default ``directory /
            "tiny-llama"``); instances that must share a tier share it (the model name is its
            path, and it is part of what a shared tier's keys are made of).
        connector_cls: the connector class of both sides (default vLLM's
            ``OffloadingConnector``; a subclass is loaded by the scheduler from its module).
        kv_load_failure_policy: what vLLM does with blocks the connector reports as failed
            loads: ``"fail"`` the request (vLLM's default) or ``"recompute"`` them.

    Attributes:
        scheduler: vLLM's ``Scheduler``; ``scheduler.connector`` is the scheduler side.
        worker_connector: the ``OffloadingConnector`` in the worker role.
        kv_caches: layer name -> float32 CPU tensor ``[num_gpu_blocks, heads, block_size, 2 *
            head_dim]``, the "GPU" KV cache the worker side copies from and to.
        loaded_tokens: request id -> tokens it did not compute itself when it first ran (GPU
            prefix-cache hits plus connector loads; only loads after `drop_gpu_prefix_cache`).
        mismatched_blocks: ``(request id, block index)`` of every full block whose bytes did
            not equal `expected_block` when the request first ran after a load.
        event_batches: with ``enable_kv_events``, every ``KVEventBatch`` the scheduler
            published (GPU prefix-cache events and the connector's, vLLM's own classes).
    """

    def __init__(
        self,
        directory: Path,
        extra_config: dict[str, Any],
        *,
        num_gpu_blocks: int = 64,
        block_size: int = 16,
        max_num_batched_tokens: int = 512,
        enable_kv_events: bool = False,
        model_dir: Path | None = None,
        connector_cls: type[OffloadingConnector] = OffloadingConnector,
        kv_load_failure_policy: str = "fail",
    ) -> None:
        model_dir = write_tiny_llama(Path(model_dir or Path(directory) / "tiny-llama"))
        self.block_size = block_size
        self.vllm_config = make_vllm_config(
            model_dir,
            extra_config,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_kv_events=enable_kv_events,
            connector=connector_cls.__name__,
            connector_module_path=(
                None if connector_cls is OffloadingConnector else connector_cls.__module__
            ),
            kv_load_failure_policy=kv_load_failure_policy,
        )
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_DIM,
            dtype=torch.float32,
        )
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(self.layer_names), spec)],
        )
        with set_current_vllm_config(self.vllm_config):
            self.scheduler = Scheduler(
                vllm_config=self.vllm_config,
                kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=block_size,
                log_stats=True,
            )
            self.worker_connector = connector_cls(
                self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
            )
            gen = torch.Generator().manual_seed(1234)
            self.kv_caches = {
                name: torch.rand(
                    (num_gpu_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_DIM), generator=gen
                )
                + 2.0  # "never zeros": distinct from anything the fake model writes
                for name in self.layer_names
            }
            self.worker_connector.register_kv_caches(self.kv_caches)
        self.event_batches: list[Any] = []
        if enable_kv_events:  # keep what the scheduler publishes (KVEventBatch per step)
            self.scheduler.kv_event_publisher = _RecordingPublisher(self.event_batches)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_size, sha256)
        self._forward = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self._next_id = 0
        self._pending_check: set[str] = set()
        self.loaded_tokens: dict[str, int] = {}
        self.mismatched_blocks: list[tuple[str, int]] = []
        self.num_steps = 0
        self.num_preemptions = 0

    # -- requests -----------------------------------------------------------------------------

    @property
    def manager(self) -> Any:
        """The scheduler side's ``OffloadingManager`` (vLLM's, or the spec's own)."""
        return self.scheduler.connector.connector_scheduler.manager  # type: ignore[union-attr]

    @property
    def worker(self) -> Any:
        """The spec's ``OffloadingWorker`` on the worker side."""
        return self.worker_connector.connector_worker.worker  # type: ignore[union-attr]

    def add_request(self, prompt_token_ids: Sequence[int], *, max_tokens: int = 1) -> str:
        """Queue a request (greedy, ``max_tokens`` outputs); returns its id."""
        req_id = f"req-{self._next_id}"
        self._next_id += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._hasher,
        )
        self.scheduler.add_request(request)
        self._pending_check.add(req_id)
        return req_id

    def block_ids(self, req_id: str) -> list[int]:
        """The GPU block ids of a running request, in order (its only KV cache group)."""
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def expected_block(self, token_ids: Sequence[int], index: int) -> np.ndarray:
        """float32 ``[layers, heads, block_size, 2 * head_dim]``: what the fake model writes
        into the block holding tokens ``index * block_size ..`` of this token sequence."""
        bs = self.block_size
        rows = _token_rows(token_ids, index * bs, (index + 1) * bs)  # [bs, L, H, C]
        return np.ascontiguousarray(rows.transpose(1, 2, 0, 3))

    def gpu_block(self, block_id: int) -> np.ndarray:
        """float32 ``[layers, heads, block_size, 2 * head_dim]``: a GPU block's bytes now."""
        return np.stack([self.kv_caches[n][block_id].numpy() for n in self.layer_names])

    def drop_gpu_prefix_cache(self, *, reset_connector: bool = False, poison: float = -7.0) -> None:
        """Evict every cached GPU block (``reset_prefix_cache``; with ``reset_connector`` also
        the connector's cache, e.g. the CPU tier above a secondary tier) and fill the free
        blocks with ``poison``, so a later hit must come from the connector. Blocks a store job
        may still read (in flight, or not yet built for a finished request) are not poisoned:
        vLLM never writes a free block, it flushes such a job before handing the block out."""
        reset = self.scheduler.reset_prefix_cache(reset_connector=reset_connector)
        assert reset, "prefix cache reset refused"
        held = {b for r in self.scheduler.running for b in self.block_ids(r.request_id)}
        # vLLM frees a finished request's blocks while its store may still read them (the
        # connector flushes that job before the block is handed out again): not poisoned
        side = getattr(self.scheduler.connector, "connector_scheduler", None)
        held.update(getattr(side, "_block_id_to_pending_jobs", ()))
        for status in getattr(side, "_req_status", {}).values():  # stores not yet built
            for group in status.group_states:
                held.update(group.block_ids)
        free = [b for b in range(self.kv_cache_config.num_blocks) if b not in held]
        for tensor in self.kv_caches.values():
            tensor[free] = poison

    # -- stepping -----------------------------------------------------------------------------

    def step(self) -> Any:
        """One engine step; returns vLLM's ``SchedulerOutput``."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        wc = self.worker_connector
        wc.handle_preemptions(meta)
        wc.bind_connector_metadata(meta)
        wc.start_load_kv(self._forward)
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        self._check_loads(starts)
        for req_id, start in starts.items():
            self._model_writes(req_id, start, start + out.num_scheduled_tokens[req_id])
        wc.wait_for_save()  # vLLM's runner calls it with no tokens scheduled too
        sending, recving = wc.get_finished(out.finished_req_ids)
        connector_output = KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            kv_connector_worker_meta=wc.build_connector_worker_meta(),
            invalid_block_ids=wc.get_block_ids_with_load_errors(),
        )
        wc.clear_connector_metadata()
        req_ids = [r.request_id for r in self.scheduler.running]
        sampled = [
            [self._next_token(rid)] if self._samples(rid, starts, out) else [] for rid in req_ids
        ]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=connector_output,
        )
        self.num_preemptions += len(out.preempted_req_ids or ())
        self.scheduler.update_from_output(out, runner_output)
        self.num_steps += 1
        return out

    def run_until_finished(self, max_steps: int = 200) -> int:
        """Step until no request is left and the connector is idle; returns the steps run."""
        for n in range(max_steps):
            if not self.scheduler.has_requests() and not self.manager.has_pending_work():
                return n
            out = self.step()
            if out.total_num_scheduled_tokens == 0:
                time.sleep(0.001)  # only background transfers left: let their threads run
        raise AssertionError(f"requests still running after {max_steps} steps")

    def close(self) -> None:
        """Shut both connector sides down (tiers, regions, threads)."""
        self.worker_connector.shutdown()
        self.scheduler.shutdown()

    # -- private ------------------------------------------------------------------------------

    def _samples(self, req_id: str, starts: dict[str, int], out: Any) -> bool:
        request = self.scheduler.requests[req_id]
        scheduled = out.num_scheduled_tokens.get(req_id, 0)
        return scheduled > 0 and starts[req_id] + scheduled >= request.num_tokens

    def _next_token(self, req_id: str) -> int:
        request = self.scheduler.requests[req_id]
        return 3 + (sum(request.all_token_ids) * 31 + request.num_tokens) % (VOCAB_SIZE - 3)

    def _check_loads(self, starts: dict[str, int]) -> None:
        """Compare the full blocks a request got from the connector with what A's model wrote."""
        for req_id in self._pending_check & starts.keys():
            self._pending_check.discard(req_id)
            computed = starts[req_id]
            request = self.scheduler.requests[req_id]
            self.loaded_tokens[req_id] = computed
            ids = self.block_ids(req_id)
            for index in range(computed // self.block_size):
                want = self.expected_block(request.all_token_ids, index)
                if not np.array_equal(self.gpu_block(ids[index]), want):
                    self.mismatched_blocks.append((req_id, index))

    def _model_writes(self, req_id: str, start: int, stop: int) -> None:
        """Write tokens ``start..stop``'s KV into the request's blocks (a token at a time)."""
        if stop <= start:
            return
        request = self.scheduler.requests[req_id]
        rows = _token_rows(request.all_token_ids, start, stop)  # [n, L, H, C]
        ids = self.block_ids(req_id)
        bs = self.block_size
        for t in range(start, stop):
            block, offset = ids[t // bs], t % bs
            for layer, name in enumerate(self.layer_names):
                self.kv_caches[name][block, :, offset] = torch.from_numpy(rows[t - start, layer])
