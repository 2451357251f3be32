"""One owner's bound launches of one kernel, one per specialization of what changes per step.

Offers (re-exported by :mod:`kvmgr.kernels.launch`):
    Launches    the bound launches an owner (an issuer, a hook, a layer) keeps of one kernel

An owner launches a kernel once per step with a few arguments that change (the *varying*
positions: step tensors, sizes, strides) and the rest fixed. ``read(*varying)`` applies the
specialization rule (:func:`kvmgr.kernels.launch.rule.reader`) to them: their classes are (part
of) the key of a bound launch, their values what it writes before launching. A key seen before
costs a dict lookup, one ``pack_into`` and one driver call; a new one binds through the kernel's
process-wide :class:`~kvmgr.kernels.launch.launcher.Launcher` (compiling if needed).

An owner whose checks depend on more than the classes (shapes, strides, devices) puts those in
front of the classes in its own key (:meth:`get` / :meth:`bind`); an owner whose arguments all
vary and need no checks calls the object itself (the copy kernels). At most ``max_bound`` launches
are kept, the oldest dropped first (a dropped launch is only ever rebound: the driver copied its
arguments at each call). Not thread-safe: each owner keeps its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmgr.kernels.launch.launcher import BoundLaunch, shared_launcher
from kvmgr.kernels.launch.rule import SPECIALIZED, reader

__all__ = ["Launches"]


class Launches:
    """Bound launches of ``kernel`` for one owner.

    Args:
        kernel: a ``@triton.jit`` function.
        varying: the positions (in the kernel's parameter order) that change between launches.
        hints: per varying position ``"t"`` (always a tensor), ``"i"`` (always a number) or
            ``"?"`` (anything; the default): what the reader may skip testing.
        num_warps: warps per program (None: Triton's default), unless a bind says otherwise.
        direct: False takes Triton's own launch every time (``kernel[grid](*args)``).
        max_bound: bound launches kept.

    Attributes:
        read: ``read(*varying_args) -> (classes, values)``, the rule over the varying positions.
        launcher: the kernel's process-wide launcher.
    """

    def __init__(
        self, kernel: Any, varying: Sequence[int], hints: str | None = None, *,
        num_warps: int | None = None,
        direct: bool = True, max_bound: int = 64,
    ) -> None:  # fmt: skip
        self.launcher = shared_launcher(kernel, direct)
        # the kernel's declared kinds also where launches are Triton's (the interpreter), so
        # owners key their launches alike everywhere; unknown: the specialized rule, the finer
        kinds = self.launcher.declared
        self.read = reader([SPECIALIZED if kinds is None else kinds[i] for i in varying], hints)
        self.varying = tuple(varying)
        self._num_warps = num_warps
        self._max_bound = max_bound
        self._bound: dict[Any, BoundLaunch] = {}

    @property
    def num_bound(self) -> int:
        """Bound launches held."""
        return len(self._bound)

    def bound(self) -> list[BoundLaunch]:
        """The bound launches held, oldest first."""
        return list(self._bound.values())

    def get(self, key: Any) -> BoundLaunch | None:
        """The launch bound for ``key``, or None."""
        return self._bound.get(key)

    def bind(self, key: Any, grid: tuple[int, ...], args: Sequence[Any], num_warps: int | None = None) -> BoundLaunch:  # fmt: skip
        """Bind a launch with ``args`` (every parameter, in order) and keep it under ``key``.

        Raises whatever Triton raises compiling these arguments only when its own launch does.
        """
        bound = self.launcher.bind(grid, *args, num_warps=num_warps or self._num_warps,
                                   varying=self.varying)  # fmt: skip
        if len(self._bound) >= self._max_bound:
            del self._bound[next(iter(self._bound))]
        self._bound[key] = bound
        return bound

    def __call__(self, grid: tuple[int, int, int], stream: Any, *args: Any) -> None:
        """Launch with ``args`` (every parameter, all varying) on ``stream`` (a torch stream;
        None: the current one), keyed by their classes alone."""
        classes, values = self.read(*args)
        bound = self._bound.get(classes)
        if bound is None:
            bound = self.bind(classes, grid, args)
        bound.run(grid, stream, values, args)
