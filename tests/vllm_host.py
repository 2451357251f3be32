"""vLLM's own CPU and tiering specs with a worker that runs on CPU tensors (tests only).

Offers (loadable by vLLM with ``"spec_module_path": "vllm_support"``, which re-exports them, or
``"vllm_host"``):
    HostOffloadingWorker        an ``OffloadingWorker`` copying pages with torch indexing at submit
    HostCPUOffloadingSpec       vLLM's ``CPUOffloadingSpec`` (its manager, any policy) + that worker
    HostTieringOffloadingSpec   vLLM's ``TieringOffloadingSpec`` (CPU primary + secondary tiers) +
                                that worker, writing the shared region the scheduler's tiers read

vLLM's own worker needs CUDA; this one lets its scheduler side run end to end on a CPU machine.
Importing this module skips the importing test module when vLLM is missing (and fails instead
with ``KVMGR_REQUIRE_VLLM=1``, as in CI).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# vLLM and the torch modules it pulls in warn at import time (deprecations outside kvmgr); the
# suite turns warnings into errors, so the imports run with warnings ignored.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
        import vllm  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        if os.environ.get("KVMGR_REQUIRE_VLLM") == "1":
            raise ImportError(f"KVMGR_REQUIRE_VLLM=1 but vLLM is missing: {exc}") from exc
        pytest.skip(
            "needs vLLM 0.33 (pip install 'kvmgr[vllm]' plus the --no-deps vllm wheel, see "
            "docs/guides/vllm.md)",
            allow_module_level=True,
        )
    from vllm.v1.kv_offload.base import (
        BlockIDsLoadStoreSpec,
        CanonicalKVCaches,
        GPULoadStoreSpec,
        LoadStoreSpec,
        OffloadingWorker,
        TransferResult,
    )
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["HostCPUOffloadingSpec", "HostOffloadingWorker", "HostTieringOffloadingSpec"]


class HostOffloadingWorker(OffloadingWorker):
    """An ``OffloadingWorker`` over CPU tensors: pages copied with torch indexing at submit.

    Args:
        kv_caches: the connector's canonical KV caches (int8 ``[num_gpu_blocks, page]`` views).
        cpu_tensors: one int8 ``[num_chunks, page * blocks_per_chunk]`` tensor per canonical
            tensor (the CPU tier).
        blocks_per_chunk: GPU blocks per offloaded chunk.

    ``fail_next`` (a count) makes the next jobs report ``success=False`` without copying; vLLM
    0.33's connector asserts on that, which tests use to show what vLLM does with a failure.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        cpu_tensors: Sequence[torch.Tensor],
        blocks_per_chunk: int,
    ) -> None:
        self.gpu = [
            t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors
        ]
        self.pages = [t.page_size_bytes for t in kv_caches.tensors]
        self.cpu = list(cpu_tensors)
        self.blocks_per_chunk = blocks_per_chunk
        self.finished: list[TransferResult] = []
        self.fail_next = 0
        self.num_stores = self.num_loads = 0
        self.on_shutdown: Any = None  # called after the worker let go of its CPU views

    def _pairs(
        self, gpu_spec: GPULoadStoreSpec, cpu_spec: LoadStoreSpec
    ) -> list[tuple[int, int, int]]:
        """(gpu block, cpu chunk, sub-block) for every GPU block of the job."""
        assert isinstance(cpu_spec, BlockIDsLoadStoreSpec)
        gpu_ids, chunk_ids = gpu_spec.block_ids.tolist(), cpu_spec.block_ids.tolist()
        bpc, out, g0, c0 = self.blocks_per_chunk, [], 0, 0
        for size, first in zip(gpu_spec.group_sizes, gpu_spec.block_indices):
            skip = first % bpc
            for k in range(size):
                pos = skip + k
                out.append((gpu_ids[g0 + k], chunk_ids[c0 + pos // bpc], pos % bpc))
            g0 += size
            c0 += -(-(skip + size) // bpc) if size else 0
        return out

    def _run(self, job_id: int, pairs: list[tuple[int, int, int]], to_cpu: bool) -> bool:
        if self.fail_next > 0:
            self.fail_next -= 1
            self.finished.append(TransferResult(job_id, False))
            return True
        num_bytes = 0
        for gpu, cpu, page in zip(self.gpu, self.cpu, self.pages):
            for block, chunk, sub in pairs:
                lo = sub * page
                if to_cpu:
                    cpu[chunk, lo : lo + page] = gpu[block]
                else:
                    gpu[block] = cpu[chunk, lo : lo + page]
                num_bytes += page
        self.finished.append(TransferResult(job_id, True, num_bytes, 0.0))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self.num_stores += 1
        return self._run(job_id, self._pairs(src_spec, dst_spec), to_cpu=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:  # fmt: skip
        self.num_loads += 1
        return self._run(job_id, self._pairs(dst_spec, src_spec), to_cpu=False)

    def get_finished(self) -> list[TransferResult]:
        done, self.finished = self.finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every job completed at submit

    def shutdown(self) -> None:
        self.cpu.clear()
        if self.on_shutdown is not None:
            self.on_shutdown()


class HostCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's ``CPUOffloadingSpec`` (its manager, any policy) with `HostOffloadingWorker`."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            cpu = [
                torch.zeros(
                    self.num_chunks, t.page_size_bytes * self.blocks_per_chunk, dtype=torch.int8
                )
                for t in kv_caches.tensors
            ]
            self._worker = HostOffloadingWorker(kv_caches, cpu, self.blocks_per_chunk)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]


class HostTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` (primary CPU tier + ``secondary_tiers``) with
    `HostOffloadingWorker` writing the shared region the scheduler's tiers read."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            cpu = [
                self._region.create_next_worker_view(t.page_size_bytes * self.blocks_per_chunk)
                for t in kv_caches.tensors
            ]
            worker = HostOffloadingWorker(kv_caches, cpu, self.blocks_per_chunk)
            worker.on_shutdown = self._region.cleanup
            del cpu
            self._worker = worker  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]
