"""The optional engine methods a ``ScriptedEngine`` offers when the test gives them.

Private to ``kvmgr.testing``. Offers:
    OPTIONAL_HOOKS   the methods the manager looks up on an engine with ``getattr``
    EngineHooks      sets the given ones on the engine and closes the host regions they made

The manager's worker asks an engine for ``plan_duplex`` (which direction a step with both
submits first, as engine ``"auto"`` does), ``plan_duplex_plans`` (the same, given the plans) and
``allocate_host_region`` (the CPU tier as a region pinned in pieces). A test that scripts these
gives them as ``ScriptedEngine(hooks={...})`` instead of writing an engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvmgr.errors import ConfigError

__all__ = ["OPTIONAL_HOOKS", "EngineHooks"]

#: ``name -> what it is called with and returns`` (see ``kvmgr.worker.worker``).
OPTIONAL_HOOKS = {
    "plan_duplex": "(d2h, h2d) counts -> the directions in submission order",
    "plan_duplex_plans": "(d2h plan, h2d plan) -> the directions in submission order",
    "allocate_host_region": "HostRegionLayout -> PinnedRegion (closed with the engine)",
}


class EngineHooks:
    """The hooks of one engine, set on it as attributes (the manager finds them with getattr).

    Args:
        hooks: ``name -> callable`` for names in ``OPTIONAL_HOOKS``.
        engine: the engine to set them on.

    Raises:
        ConfigError: a name not in ``OPTIONAL_HOOKS``, or a value that is not callable.
    """

    def __init__(self, hooks: Mapping[str, Callable[..., Any]], engine: object) -> None:
        unknown = sorted(set(hooks) - set(OPTIONAL_HOOKS))
        if unknown:
            raise ConfigError(f"unknown engine hooks {unknown}; known: {list(OPTIONAL_HOOKS)}")
        for name, hook in hooks.items():
            if not callable(hook):
                raise ConfigError(f"engine hook {name!r}: expected a callable, got {hook!r}")
        self._regions: list[Any] = []
        for name, hook in hooks.items():
            if name == "allocate_host_region":
                hook = self._tracked(hook)
            setattr(engine, name, hook)

    def close(self) -> None:
        """Close every host region ``allocate_host_region`` returned (as a real engine does)."""
        regions, self._regions = self._regions, []
        for region in regions:
            region.close()

    def _tracked(self, allocate: Callable[..., Any]) -> Callable[..., Any]:
        def allocate_host_region(layout: Any) -> Any:
            region = allocate(layout)
            self._regions.append(region)
            return region

        return allocate_host_region
