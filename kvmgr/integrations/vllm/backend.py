"""kvmgr's whole offloading backend for vLLM 0.33: an ``OffloadingSpec`` (issue 22, part 3).

Offers:
    KvmgrOffloadingSpec       loaded by vLLM's ``OffloadingConnector`` through ``spec_name`` +
                              ``spec_module_path``; ``get_manager()`` is kvmgr's scheduler-side
                              bookkeeping (`KvmgrOffloadingManager`), ``get_worker()`` kvmgr's
                              per-rank transfer worker (`KvmgrOffloadingWorker`)
    KvmgrOffloadingConnector  vLLM's ``OffloadingConnector`` plus one thing it lacks: failed
                              CPU -> GPU copies reported as load errors, so vLLM recomputes
                              those blocks (``kv_connector`` + ``kv_connector_module_path``)
    KvmgrOffloadingManager, KvmgrOffloadingWorker, KvmgrChunkSpec, WorkerStatistics

Config (``kv_connector_extra_config``; docs/guides/vllm.md has a runnable one)::

    {"spec_name": "KvmgrOffloadingSpec",
     "spec_module_path": "kvmgr.integrations.vllm.backend",
     "cpu_bytes_to_use": 34359738368,     # the CPU tier, all ranks together (as vLLM's)
     "kvmgr_policy": "arc",               # any kvmgr policy (default "lru")
     "kvmgr_engine": "auto",              # kvmgr engine of every rank (default "auto")
     "kvmgr_fault_dir": "/dev/shm"}       # where the fault table lives (default: /dev/shm)

The CPU tier holds ``cpu_bytes_to_use // (world_size * kv bytes of one rank's chunk)`` chunks;
every rank keeps its own pages of each chunk in its own host allocation (pinned by the engine).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvmgr.errors import ConfigError
from kvmgr.integrations.vllm._backend_manager import KvmgrOffloadingManager
from kvmgr.integrations.vllm._backend_worker import KvmgrOffloadingWorker, WorkerStatistics
from kvmgr.integrations.vllm._fault_table import FaultTable, fault_table_path
from kvmgr.integrations.vllm._store_seqs import KvmgrChunkSpec
from kvmgr.policy import POLICIES

__all__ = [
    "KvmgrChunkSpec",
    "KvmgrOffloadingConnector",
    "KvmgrOffloadingManager",
    "KvmgrOffloadingSpec",
    "KvmgrOffloadingWorker",
    "WorkerStatistics",
]


class KvmgrOffloadingSpec(OffloadingSpec):
    """vLLM ``OffloadingSpec`` whose manager and workers are kvmgr's (module docstring).

    Args:
        config: vLLM's normalized offloading config; ``extra_config`` keys ``cpu_bytes_to_use``
            (required), ``kvmgr_policy``, ``kvmgr_engine``, ``kvmgr_fault_dir``.

    Raises:
        ConfigError: ``cpu_bytes_to_use`` missing, not an integer or not positive, an unknown
            policy, a tier too small for one chunk, or a ``kvmgr_fault_dir`` that is not a
            directory (the fault table cannot be created there: at ``get_manager``/``get_worker``).
    """

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """vLLM's CPU-tier gauges and allocation histogram (the manager fills the same names)."""
        return CPUOffloadingSpec.build_metric_definitions({})

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return CPUOffloadingInfo.config_info_keys()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        extra = self.extra_config
        cpu_bytes = _cpu_bytes(extra.get("cpu_bytes_to_use"))
        if cpu_bytes <= 0:
            raise ConfigError(
                "KvmgrOffloadingSpec: kv_connector_extra_config needs cpu_bytes_to_use > 0, "
                f"got {extra.get('cpu_bytes_to_use')!r}"
            )
        self.policy = str(extra.get("kvmgr_policy", "lru"))
        if self.policy not in POLICIES or self.policy == "opt":
            raise ConfigError(
                f"KvmgrOffloadingSpec: unknown kvmgr_policy {self.policy!r}; supported: "
                + ", ".join(p for p in POLICIES if p != "opt")
            )
        self.engine = str(extra.get("kvmgr_engine", "auto"))
        self.world_size = max(1, config.parallel.world_size)
        self.rank = config.parallel.rank
        chunk_bytes = config.worker_kv_bytes_per_block * self.world_size * self.blocks_per_chunk
        self.num_chunks = cpu_bytes // chunk_bytes if chunk_bytes > 0 else 0
        self.cpu_info = CPUOffloadingInfo.from_config(config, self.num_chunks, chunk_bytes)
        fault_dir = extra.get("kvmgr_fault_dir")
        if fault_dir is not None and (
            not isinstance(fault_dir, str | os.PathLike) or not os.path.isdir(fault_dir)
        ):
            raise ConfigError(
                f"KvmgrOffloadingSpec: kvmgr_fault_dir {fault_dir!r} is not a directory"
            )
        self._fault_path = fault_table_path(config.engine_id, fault_dir)
        self._manager: KvmgrOffloadingManager | None = None
        self._worker: KvmgrOffloadingWorker | None = None

    def _faults(self) -> FaultTable:
        if self.num_chunks < 1:
            raise ConfigError(
                f"KvmgrOffloadingSpec: cpu_bytes_to_use={self.extra_config['cpu_bytes_to_use']} "
                "is too small for one chunk"
            )
        try:
            return FaultTable(self._fault_path, self.world_size, self.num_chunks)
        except OSError as exc:  # not writable, no room
            raise ConfigError(
                f"KvmgrOffloadingSpec: cannot create the fault table {self._fault_path}: {exc} "
                "(kvmgr_fault_dir)"
            ) from exc

    def get_manager(self) -> OffloadingManager:
        """The scheduler side's manager (built once)."""
        if self._manager is None:
            self._manager = KvmgrOffloadingManager(
                self.num_chunks,
                self.policy,
                faults=self._faults(),
                enable_events=self.kv_events_config.enable_kv_cache_events,
                config_info=self.cpu_info.as_config_info(),
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """This rank's worker (built once) over vLLM's canonical KV caches."""
        if self._worker is None:
            self._worker = KvmgrOffloadingWorker(
                kv_caches,
                num_chunks=self.num_chunks,
                blocks_per_chunk=self.blocks_per_chunk,
                rank=self.rank,
                faults=self._faults(),
                engine=self.engine,
            )
        return self._worker


class KvmgrOffloadingConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` whose worker side reports failed loads as load errors.

    With ``KvmgrOffloadingSpec``, a CPU -> GPU batch that failed hands its GPU block ids to
    ``get_block_ids_with_load_errors``; vLLM's scheduler then recomputes those blocks
    (``kv_load_failure_policy="recompute"``, its default) instead of the worker raising. Every
    other call is vLLM's.
    """

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        worker = self._kvmgr_worker()
        if worker is not None:
            worker.report_load_errors = True

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._kvmgr_worker()
        return worker.take_load_errors() if worker is not None else set()

    def _kvmgr_worker(self) -> KvmgrOffloadingWorker | None:
        side = self.connector_worker
        worker = side.worker if side is not None else None
        return worker if isinstance(worker, KvmgrOffloadingWorker) else None


def _cpu_bytes(value: object) -> int:
    """``cpu_bytes_to_use`` as an int (0 when missing); a string of digits is read as vLLM's
    ``CPUOffloadingSpec`` reads it (``int()``); ``ConfigError`` for no number ("32GB")."""
    if value is None:
        return 0
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise ConfigError(
                f"KvmgrOffloadingSpec: expected cpu_bytes_to_use a number of bytes, got {value!r}"
            ) from None
    if isinstance(value, bool | bytes) or not isinstance(value, numbers.Real):
        raise ConfigError(
            f"KvmgrOffloadingSpec: expected cpu_bytes_to_use a number of bytes, got {value!r}"
        )
    if not math.isfinite(value):
        raise ConfigError(f"KvmgrOffloadingSpec: cpu_bytes_to_use {value!r} is not finite")
    return int(value)
