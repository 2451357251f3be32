"""Eviction and admission policies for the CPU tier, selected by name.

Offers:

- `EvictionPolicy`: the batch protocol v2 (``insert(keys, parents)``, ``touch(keys)``,
  ``remove(keys)``, ``evict(n, can_evict, protected)``, ``__len__``, ``__contains__``,
  ``name``); `AdmissionPolicy` adds ``admit(keys, parents)``. See `kvmgr.policy.base`.
- `LRUPolicy` (``"lru"``) and `ARCPolicy` (``"arc"``), prefix-consistent
  (`kvmgr.policy.tree`); `OptimalPolicy` (``"opt"``), the offline bound, which needs
  ``future=FutureUses(...)`` (the simulator passes it).
- `POLICIES`: the registry, name -> class; `make_policy(name, capacity, **options)` builds one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from kvmgr.errors import ConfigError
from kvmgr.policy.arc import ARCPolicy
from kvmgr.policy.base import AdmissionPolicy, EvictionPolicy, KeyPredicate, _check_capacity
from kvmgr.policy.hints import StoreHint
from kvmgr.policy.lru import LRUPolicy
from kvmgr.policy.online import OnlinePolicy
from kvmgr.policy.opt import FutureUses, OptimalPolicy
from kvmgr.policy.reuse import ReusePolicy
from kvmgr.policy.s3fifo import S3FIFOPolicy

__all__ = [
    "POLICIES",
    "ARCPolicy",
    "AdmissionPolicy",
    "EvictionPolicy",
    "FutureUses",
    "KeyPredicate",
    "LRUPolicy",
    "OnlinePolicy",
    "OptimalPolicy",
    "ReusePolicy",
    "S3FIFOPolicy",
    "StoreHint",
    "make_policy",
]

POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "reuse": ReusePolicy,
    "online": OnlinePolicy,
    "opt": OptimalPolicy,
}
"""Registry of policy classes by name; never mutated at run time."""


def make_policy(name: str, capacity: int, **options: Any) -> EvictionPolicy:
    """Build the policy registered as ``name`` for a CPU tier of ``capacity`` blocks.

    Args:
        name: A key of `POLICIES`.
        capacity: Number of CPU blocks, ``> 0``.
        **options: Keyword arguments of the policy's constructor (for example ``clock``, a
            ``Callable[[], float]`` giving seconds, for policies that measure time). Options a
            policy does not take are an error.

    Returns:
        EvictionPolicy: A new, empty policy.

    Raises:
        ConfigError: If ``name`` is not registered (the message lists the supported names),
            ``capacity`` is not an ``int`` greater than 0, or an option is not accepted.
    """
    factory = POLICIES.get(name) if isinstance(name, str) else None
    if factory is None:
        supported = ", ".join(repr(known) for known in sorted(POLICIES))
        raise ConfigError(f"unknown eviction policy {name!r}; supported: {supported}")
    capacity = _check_capacity(capacity)
    try:
        inspect.signature(factory).bind(capacity, **options)
    except TypeError as exc:
        raise ConfigError(f"policy {name!r}: bad options {sorted(options)}: {exc}") from None
    return factory(capacity, **options)
