"""Eviction policies for the CPU tier, selected by name.

Offers:

- `EvictionPolicy`: the protocol (``insert``, ``touch``, ``remove``, ``evict``, ``__len__``,
  ``__contains__``, ``name``); see `kvmgr.policy.base`.
- `LRUPolicy` (``"lru"``) and `ARCPolicy` (``"arc"``).
- `POLICIES`: the registry, name -> class; `make_policy(name, capacity)` builds one.
"""

from __future__ import annotations

from collections.abc import Callable

from kvmgr.errors import ConfigError
from kvmgr.policy.arc import ARCPolicy
from kvmgr.policy.base import EvictionPolicy, KeyPredicate, _check_capacity
from kvmgr.policy.lru import LRUPolicy

__all__ = ["POLICIES", "ARCPolicy", "EvictionPolicy", "KeyPredicate", "LRUPolicy", "make_policy"]

POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}
"""Registry of policy classes by name; never mutated at run time."""


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build the policy registered as ``name`` for a CPU tier of ``capacity`` blocks.

    Parameters
    ----------
    name : str
        A key of `POLICIES` (``"lru"``, ``"arc"``).
    capacity : int
        Number of CPU blocks, ``> 0``.

    Returns
    -------
    EvictionPolicy
        A new, empty policy.

    Raises
    ------
    ConfigError
        If ``name`` is not registered (the message lists the supported names) or
        ``capacity`` is not an ``int`` greater than 0.
    """
    factory = POLICIES.get(name) if isinstance(name, str) else None
    if factory is None:
        supported = ", ".join(repr(known) for known in sorted(POLICIES))
        raise ConfigError(f"unknown eviction policy {name!r}; supported: {supported}")
    return factory(_check_capacity(capacity))
