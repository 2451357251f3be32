"""kvmgr's lower tiers as vLLM 0.33 ``SecondaryTierManager`` classes (``TieringOffloadingSpec``).

Offers:
    KvmgrDiskTier      kvmgr's ``DiskTier`` (preallocated slot files, direct I/O, LRU, index
                       persisted across restarts) under vLLM's CPU tier
    KvmgrSharedTier    kvmgr's ``SharedTier`` (Valkey/Redis, shared by instances) under it
    KvmgrTierManager   their common base (`kvmgr.integrations.vllm._tier_manager`)
    TierJobStatistics  what ``statistics()`` of either returns

vLLM loads them out of tree from ``secondary_tiers`` (keys other than ``type`` and
``module_path`` are this class's keyword arguments)::

    "secondary_tiers": [
        {"type": "KvmgrDiskTier", "module_path": "kvmgr.integrations.vllm.tiers",
         "path": "/mnt/nvme/kv.slots", "num_slots": 200000},
        {"type": "KvmgrSharedTier", "module_path": "kvmgr.integrations.vllm.tiers",
         "url": "redis://cache.internal:6379/0", "ttl_s": 3600}]

Every chunk goes to the backend as one blob (kvmgr's format: a header binding it to its stored
key and the instance's layout fingerprint, the chunk's bytes, an XXH3-128 checksum); a blob that
fails the check is a miss. Job results, deadlines and failures: see the table in
`kvmgr.integrations.vllm._tier_manager` and docs/guides/vllm.md.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import Locality, Medium
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvmgr.errors import ConfigError
from kvmgr.integrations.vllm._tier_jobs import TierJobStatistics
from kvmgr.integrations.vllm._tier_manager import KvmgrTierManager
from kvmgr.tiers import DiskTier, TierBackend

__all__ = ["KvmgrDiskTier", "KvmgrSharedTier", "KvmgrTierManager", "TierJobStatistics"]


class KvmgrDiskTier(KvmgrTierManager):
    """kvmgr's ``DiskTier`` as a vLLM secondary tier (local storage).

    Args:
        path: first slot file (created and preallocated; more files get ``.1``, ``.2``, ...).
        num_slots: chunks the tier holds; or give ``capacity_bytes`` instead.
        capacity_bytes: disk bytes to use (``num_slots = capacity_bytes // slot bytes``).
        num_files, direct, io_threads, persist_index: as ``DiskTier`` (its defaults).
        deadline_s: deadline of every disk call, seconds (``DiskTier``'s default: 5).
        offloading_spec, primary_kv_view, tier_type, backpressure_detector, tenant_salt,
            key_prefix, max_known_keys: as `KvmgrTierManager` (``locality`` is always LOCAL).

    Raises:
        ConfigError: neither or both of ``num_slots`` and ``capacity_bytes``, or bad sizes.
        TierUnavailableError: the file cannot be created or preallocated.
    """

    medium: ClassVar[Medium | None] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.DISK

    def _configure(
        self,
        *,
        path: str,
        num_slots: int | None = None,
        capacity_bytes: int | None = None,
        **disk_options: Any,
    ) -> None:
        if (num_slots is None) == (capacity_bytes is None):
            raise ConfigError("KvmgrDiskTier: give exactly one of num_slots and capacity_bytes")
        self._disk_options = dict(disk_options, path=os.fspath(path))
        self._num_slots, self._capacity_bytes = num_slots, capacity_bytes

    def _locality(self, locality: str | None) -> Locality:
        return Locality.LOCAL  # local storage, whatever the option says

    async def _open_backend(self) -> TierBackend:
        slot_bytes = self.namespace.blob_bytes
        num_slots = self._num_slots
        if num_slots is None:
            assert self._capacity_bytes is not None
            num_slots = int(self._capacity_bytes) // (-(-slot_bytes // 4096) * 4096)
        return DiskTier(slot_bytes=slot_bytes, num_slots=num_slots, **self._disk_options)


class KvmgrSharedTier(KvmgrTierManager):
    """kvmgr's ``SharedTier`` (a Valkey or Redis server) as a vLLM secondary tier.

    Args:
        url: ``redis://HOST:PORT/DB``, ``rediss://``, ``valkey://``, ``valkeys://`` or
            ``unix:///path``; credentials preferably from ``password_file`` / ``password_env``.
        ttl_s: expire stored chunks after this many seconds (``None``: the server's policy).
        deadline_s: deadline of every server call, seconds.
        **options: the other ``SharedTier`` arguments (``username``, ``password_file``,
            ``password_env``, ``connect_timeout_s``, ``hint_deadline_s``, ``max_connections``,
            ``reconnect_backoff_s``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
            ``single_tenant``...; see ``SharedTier``, whose defaults apply) and
            ``offloading_spec``, ``primary_kv_view``, ``tier_type``, ``backpressure_detector``,
            ``tenant_salt``, ``key_prefix``, ``max_known_keys``, ``locality`` (default
            REMOTE; `KvmgrTierManager`).

    Raises:
        ConfigError: a bad URL or limit.
    """

    medium: ClassVar[Medium | None] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def _configure(self, *, url: str, **shared_options: Any) -> None:
        self._shared_options = dict(shared_options, url=url)

    def _locality(self, locality: str | None) -> Locality:
        return Locality(locality if locality is not None else "REMOTE")

    async def _open_backend(self) -> TierBackend:
        from kvmgr.tiers.shared import SharedTier

        return SharedTier(**self._shared_options)
