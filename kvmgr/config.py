"""Configuration: frozen, validated attrs classes.

Offers:
    ManagerConfig   settings of an ``OffloadManager``

Configs are never mutated: derive a variant with ``attrs.evolve(config, field=value)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from attrs import validators as v

from kvmgr.errors import ConfigError

__all__ = ["FLUSH_MODES", "ManagerConfig"]
#: "step": ``step()`` flushes; "tick": everything queued in one event-loop tick is flushed.
FLUSH_MODES = ("step", "tick")
#: What a store that cannot make room does: fail at once, or wait (bounded) for room.
BACKPRESSURE_MODES = ("fail", "wait")
#: How CUDA engines page-lock the CPU tier: the rest in the background, or all before returning.
PIN_MODES = ("background", "sync")


def _policy_name(instance: Any, attribute: Any, value: str) -> None:
    from kvmgr.policy import POLICIES

    if not isinstance(value, str) or value not in POLICIES:
        raise ConfigError(f"unknown policy {value!r}; supported: {', '.join(sorted(POLICIES))}")


#: The engines' names: ``kvmgr.transfer.ENGINES`` holds one factory per name (kept equal by
#: tests/scheduler/test_scheduler_split.py), named here so the scheduler side validates without torch.
ENGINE_NAMES = ("host", "cuda", "kernel", "auto")


def _engine_name(instance: Any, attribute: Any, value: str) -> None:
    if not isinstance(value, str) or value not in ENGINE_NAMES:
        raise ConfigError(f"engine: expected one of {sorted(ENGINE_NAMES)}, got {value!r}")


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(f"{attribute.name}: expected one of {choices}, got {value!r}")

    return check


def _bool(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name}: expected True or False, got {value!r}")


def _mapping(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{attribute.name}: expected a mapping of str keys, got {value!r}")


def _positive(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{attribute.name}: expected an int >= 1, got {value!r}")


def _non_negative(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{attribute.name}: expected an int >= 0, got {value!r}")


#: Largest CPU tier accepted (2**40 blocks): beyond it the sizes overflow int64 byte counts.
MAX_CPU_BLOCKS = 1 << 40
#: Most KV events kept (2**32): the event deque's length is a C ``Py_ssize_t``, and a larger
#: count would only hold memory a router never reads.
MAX_EVENTS = 1 << 32


def _event_count(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _non_negative(instance, attribute, value)
    if value > MAX_EVENTS:
        raise ConfigError(f"{attribute.name}: expected at most {MAX_EVENTS}, got {value}")


def _cpu_blocks(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _positive(instance, attribute, value)
    if value > MAX_CPU_BLOCKS:
        raise ConfigError(f"{attribute.name}: expected at most 2**40 blocks, got {value!r}")


@attrs.frozen(kw_only=True)
class ManagerConfig:
    """Settings of an ``OffloadManager``.

    Attributes:
        num_cpu_blocks: blocks in the CPU tier (each holds one page of every KV tensor).
        policy: eviction policy of the CPU tier: ``"lru"``, ``"arc"``, ``"s3fifo"``, ``"reuse"``
            or ``"online"`` (``"opt"``, the offline bound, needs the simulator's future uses).
        engine: ``"host"`` (CPU tensors, real copies on a worker thread), ``"cuda"`` (batched
            driver copy), ``"kernel"`` (SM copy kernel) or ``"auto"`` (host without CUDA tensors,
            else the per-batch choice between DMA and kernel).
        flush: ``"step"`` (``step()`` flushes the queue) or ``"tick"`` (each event-loop tick).
        manage_gpu_blocks: the manager owns an allocator over all GPU blocks for the
            request-level API (``allocate``, ``resume``).
        merge: merge adjacent pages into one descriptor.
        max_descriptors: descriptor cap per submitted chunk; ``None`` = the engine's default.
        backpressure: a store that cannot make room ``"fail"``s with ``PoolExhaustedError`` or
            ``"wait"``s up to ``store_wait_s`` seconds for blocks to become evictable.
        store_wait_s: bound of the wait, seconds (finite: a store never waits for ever).
        allow_pageable: CUDA engines may fall back (logged) to pageable host memory when
            registration fails, instead of raising.
        pin_host: the CUDA engines the manager builds page-lock the CPU tier
            ``"background"`` (the first GiB before the manager is built, the rest on a thread
            while it runs: blocks become usable piece by piece,
            ``ManagerStatistics.cpu_blocks_ready``) or ``"sync"`` (all of it before the
            constructor returns); an engine passed in keeps its own ``pin`` option.
            docs/guides/pinned-tier.md.
        store_threshold: a key is stored only once a store of it was asked this many times
            (vLLM's ``store_threshold``); 1 stores on first sight. Keys held back are counted in
            ``ManagerStatistics.stores_not_admitted``.
        tier_write_back: blocks the CPU tier evicts are written to the first lower tier (when
            the manager has lower tiers), instead of dropped.
        tier_write_through: every completed store is also written to every lower tier, so other
            instances sharing the tier can use it at once.
        max_events: KV events kept for ``take_events()``/``events()`` before the oldest are
            dropped; 0 records none; at most ``MAX_EVENTS`` (2**32).
        policy_options: keyword arguments for the policy's constructor
            (``make_policy(policy, num_cpu_blocks, **policy_options)``), e.g. ``clock``.
    """

    num_cpu_blocks: int = attrs.field(validator=_cpu_blocks)
    policy: str = attrs.field(default="lru", validator=_policy_name)
    engine: str = attrs.field(default="auto", validator=_engine_name)
    flush: str = attrs.field(default="step", validator=_one_of(FLUSH_MODES))
    manage_gpu_blocks: bool = attrs.field(default=True, validator=_bool)
    merge: bool = attrs.field(default=True, validator=_bool)
    max_descriptors: int | None = attrs.field(default=None, validator=v.optional(_positive))
    backpressure: str = attrs.field(default="fail", validator=_one_of(BACKPRESSURE_MODES))
    store_wait_s: float = attrs.field(default=1.0)
    allow_pageable: bool = attrs.field(default=False, validator=_bool)
    pin_host: str = attrs.field(default="background", validator=_one_of(PIN_MODES))
    store_threshold: int = attrs.field(default=1, validator=_positive)
    max_events: int = attrs.field(default=4096, validator=_event_count)
    tier_write_back: bool = attrs.field(default=True, validator=_bool)
    tier_write_through: bool = attrs.field(default=False, validator=_bool)
    policy_options: Mapping[str, Any] = attrs.field(factory=dict, validator=_mapping, hash=False)

    @store_wait_s.validator
    def _check_wait(self, attribute: attrs.Attribute[Any], value: float) -> None:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 <= value < float("inf")
        ):
            raise ConfigError(f"store_wait_s: expected finite seconds >= 0, got {value!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ManagerConfig:
        """Build from parsed input (JSON, CLI); unknown keys are an error.

        Raises:
            ConfigError: an unknown key or an invalid value.
        """
        known = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(str(exc)) from None
