"""The state write of a steady loop: one C++ tensor check per step instead of the key (private).

Offers (to :mod:`kvmgr.kernels.c128.host`):
    WriteGuard   the bound state write of a write key found on two steps in a row, and torch's
                 C++ tensor check of that step; later steps that pass it skip the key

A serving loop passes new step tensors every step (``kv``, ``score``, ``positions``, the state
slots) of one layout. :class:`~kvmgr.kernels.c128.host.Layer` finds their launch by a key of
about 25 attribute reads and the specialization rule's classes; once a key has come twice in a
row, :meth:`WriteGuard.remember` keeps its bound launch with
:func:`~kvmgr._tensor_guard.tensor_guard` of that step (dtype, device, every size and
stride of the four tensors: what the key and the ints' classes are made of). A later step that
passes the guard (its verdict and the pointers in one C call:
:func:`kvmgr.kernels.launch.native.checked_data_ptrs`) and whose four bases are 16-byte aligned (as every base of the guarded step
was: the rule's pointer classes) has that key: :meth:`WriteGuard.launch` writes its pointers and
launches. Anything else (the guard refuses, a base is not aligned, not tensors) answers None and
the caller takes the key, which checks in full.
"""

from __future__ import annotations

from typing import Any

from kvmgr._tensor_guard import tensor_guard
from kvmgr.kernels.launch.native import checked_data_ptrs

__all__ = ["WriteGuard"]

_REBUILD_AFTER = 16  # refused steps of the guarded key before its guard is rebuilt


class WriteGuard:
    """One layer's guarded state write (module docstring). Not thread-safe, as the layer."""

    def __init__(self) -> None:
        # (guard, bound launch, (T, (row strides)), grid, pointer reader, key) of the guarded
        # step, or None
        self.entry: tuple[Any, ...] | None = None
        self._key: Any = None  # the last keyed step's key
        self._refused = 0  # keyed steps of the guarded key since its guard was built

    def launch(self, kv: Any, score: Any, positions: Any, state_slot_mapping: Any, stream: Any, run: bool) -> tuple[Any, ...] | None:  # fmt: skip
        """For a step that passes the guard: write its arguments into the bound launch and,
        with ``run``, launch it on ``stream``; the layer's last-write record of the step
        ``(kv, score, positions, state_slot_mapping, (pointers..., T), bound, grid)``. None
        (nothing written) for any other step, or while nothing is guarded."""
        entry = self.entry
        if entry is None:
            return None
        guard, bound, ints, grid, read, _ = entry
        try:  # the guard's verdict and the four pointers in one C call
            ptrs = read(guard.check, kv, score, positions, state_slot_mapping)
        except TypeError:  # not tensors
            return None
        if ptrs is None or (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3]) & 15:
            return None
        strides = ints[1]
        if run:
            bound.run(grid, stream, (*ptrs, *strides), (kv, score, positions, state_slot_mapping, *strides))  # fmt: skip
        else:
            bound.set((*ptrs, *strides), (kv, score, positions, state_slot_mapping, *strides))
        return kv, score, positions, state_slot_mapping, (*ptrs, ints[0]), bound, grid

    def remember(self, key: Any, bound: Any, args: tuple[Any, ...], values: tuple[Any, ...]) -> None:  # fmt: skip
        """After a keyed step (``key`` found, ``bound`` its launch; ``args`` / ``values`` its
        varying arguments and their packed values): guard ``key`` if the last keyed step had it
        too and every base is 16-byte aligned. A guard of that key that kept refusing steps
        (another grad mode) is rebuilt after 16 of them: one build per 16 such steps."""
        last, self._key = self._key, key
        if key != last or (values[0] | values[1] | values[2] | values[3]) & 15:
            return
        entry = self.entry
        if entry is not None and entry[-1] == key:
            self._refused += 1
            if self._refused < _REBUILD_AFTER:
                return
        self._refused = 0
        guard = tensor_guard(args[:4])
        num_tokens = args[2].shape[0]
        grid = (num_tokens, 1, 1)
        ints = (num_tokens, tuple(values[4:]))  # T, the row strides
        self.entry = None if guard is None else (guard, bound, ints, grid, checked_data_ptrs(), key)

    def forget(self) -> None:
        """A new key was bound: the next guard needs two keyed steps again."""
        self._key = None
