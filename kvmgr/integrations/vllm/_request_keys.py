"""What one request showed a kvmgr manager or policy: the token positions of its keys, per KV
cache group, so that a new key's prefix parent is found (the key of the same group at the
nearest lower position seen so far).

Private to ``kvmgr.integrations.vllm``. An ``OffloadKey`` is a block hash followed by its group
index (``vllm.v1.kv_offload.base.make_offload_key``); the group is named here by those trailing
bytes as they are (the same group index, the same bytes), so no key is decoded.

Offers:
    RequestKeys      positions and keys of one request, per group (kept in its ``ReqContext``)
    positions_of     the positions a ``ReqContext`` recorded for some keys, in one call
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Sequence
from itertools import islice, repeat
from typing import Any, TypeVar

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key

__all__ = ["RequestKeys", "positions_of"]

#: trailing bytes of an ``OffloadKey`` that name its KV cache group
_GROUP_BYTES = len(make_offload_key(b"", 0))


def positions_of(req_context: ReqContext) -> Callable[[OffloadKey], int | None]:
    """``req_context.get_offload_key_position`` as a plain ``dict.get`` where vLLM keeps the
    positions in a dict (0.33 does), so a batch of keys is one C-level ``map``."""
    table = getattr(req_context, "_offload_key_positions", None)
    if type(table) is dict and type(req_context).get_offload_key_position is _VLLM_GET:
        return table.get
    return req_context.get_offload_key_position


_VLLM_GET = ReqContext.get_offload_key_position


class _Group:
    """Sorted positions of one group's keys and the key at each."""

    __slots__ = ("keys", "positions")

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.keys: list[OffloadKey] = []

    def add(self, key: OffloadKey, position: int) -> None:
        positions = self.positions
        if not positions or positions[-1] < position:  # keys arrive in prefix order
            positions.append(position)
            self.keys.append(key)
            return
        i = bisect.bisect_left(positions, position)
        if positions[i] != position:  # the first key seen at a position stays
            positions.insert(i, position)
            self.keys.insert(i, key)

    def parent(self, position: int) -> OffloadKey | None:
        positions = self.positions
        if positions and positions[-1] < position:
            return self.keys[-1]
        i = bisect.bisect_left(positions, position)
        return self.keys[i - 1] if i > 0 else None


_State = TypeVar("_State", bound="RequestKeys")


class RequestKeys:
    """Positions of the keys one request showed, per KV cache group.

    Kept in the request's ``ReqContext`` (``set_state``), so it lives and dies with the
    request; ``owner`` and ``generation`` tell a manager or policy whether it is its own and
    from before a reset.

    Complexity: ``add``/``parent`` O(log keys of the group) (O(1) for keys in prefix order);
    ``extend_run`` O(len(keys)) in C-level loops.
    """

    __slots__ = ("generation", "groups", "owner")

    def __init__(self, owner: object, generation: int) -> None:
        self.owner = owner
        self.generation = generation
        self.groups: dict[bytes, _Group] = {}

    @classmethod
    def of(cls: type[_State], req_context: ReqContext, owner: object, generation: int) -> _State:
        """The ``cls`` state that ``req_context`` keeps for ``owner`` at ``generation``: the
        one kept, or a new one (set in ``req_context``) when none is, or it is another owner's
        or from before a reset."""
        state = req_context.get_state(cls)
        if state is None or state.owner is not owner or state.generation != generation:
            state = cls(owner, generation)
            req_context.set_state(state)
        return state

    def _group(self, key: OffloadKey) -> _Group:
        name = key[-_GROUP_BYTES:]
        group = self.groups.get(name)
        if group is None:
            group = self.groups[name] = _Group()
        return group

    def add(self, key: OffloadKey, position: int) -> None:
        """Record ``key`` at ``position`` (the first key recorded at a position stays)."""
        self._group(key).add(key, position)

    def add_many(self, keys: Sequence[OffloadKey], positions: Sequence[int]) -> None:
        """``add`` of each ``(keys[i], positions[i])``."""
        for key, position in zip(keys, positions):
            self._group(key).add(key, position)

    def parent(self, key: OffloadKey, position: int) -> OffloadKey | None:
        """The key of ``key``'s group at the nearest position below ``position``, if any."""
        group = self.groups.get(key[-_GROUP_BYTES:])
        return group.parent(position) if group is not None else None

    def parents(
        self, keys: Sequence[OffloadKey], positions: Sequence[int | None]
    ) -> list[OffloadKey | None]:
        """``parent`` of each ``(keys[i], positions[i])`` (``None`` where the position is)."""
        return [
            None if position is None else self.parent(key, position)
            for key, position in zip(keys, positions)
        ]

    def extend_run(
        self, keys: Sequence[OffloadKey], positions: Sequence[Any]
    ) -> list[OffloadKey | None] | None:
        """Record a run of keys past everything recorded and return their parents, or
        ``None`` (nothing recorded) when the keys are not such a run: one group, every
        position known, strictly increasing, above the group's last one. A run's parents are
        its previous keys, the first's the group's last key (the store of a prefix's next
        blocks, the common case)."""
        n = len(keys)
        if not n:
            return []
        name = keys[0][-_GROUP_BYTES:]
        if n == 1:  # one key (the per-call store): a run when its position is known
            if positions[0] is None:
                return None
        elif (
            None in positions
            or not all(map(operator.lt, positions, islice(positions, 1, None)))
            or not all(map(bytes.endswith, keys, repeat(name)))
        ):
            return None
        group = self.groups.get(name)
        if group is None:
            group = self.groups[name] = _Group()
            head = None
        elif not group.positions:
            head = None
        elif group.positions[-1] < positions[0]:
            head = group.keys[-1]
        else:
            return None
        group.positions.extend(positions)
        group.keys.extend(keys)
        parents: list[OffloadKey | None] = [head]
        if n > 1:
            parents.extend(islice(keys, n - 1))
        return parents
