"""What `StoreHint`s leave in `OnlinePolicy`: sessions' last chains, TTL expiries, reprieves.

Offers (to ``kvmgr.policy.online``):
    HintState   the three, and the eviction order they make: keys whose TTL ran out first,
                then least recently used, keys of chains with a reprieve left (a hinted or
                predicted continuation) last
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterator

from kvmgr.policy._online_cells import Chain
from kvmgr.policy.hints import StoreHint
from kvmgr.policy.tree import VictimSet

__all__ = ["HintState"]

_Order = OrderedDict[bytes, bytes | None]  # tracked key -> parent, least recently used first


class HintState:
    """Per session its last chain (at most ``capacity`` sessions), the TTL expiries of admitted
    chains in store order, and how many chains hold a reprieve.

    Args:
        capacity: CPU blocks (the bound on remembered sessions).
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self.sessions: OrderedDict[object, Chain] = OrderedDict()
        self.expiry: deque[tuple[float, list[bytes]]] = deque()  # (expires, keys)
        self._num_spared = 0  # chains with a reprieve left (they may be gone already)

    def admitted(self, chain: Chain, hint: StoreHint, take: bool, now: float) -> None:
        """A new chain with ``hint`` was admitted (``take``) or declined."""
        chain.spare = take and (hint.continue_p or 0.0) >= 0.5
        self._num_spared += chain.spare
        if hint.session is not None:
            self.sessions[hint.session] = chain
            self.sessions.move_to_end(hint.session)
            if len(self.sessions) > self._capacity:
                self.sessions.popitem(last=False)
        if hint.ttl_s is not None and take:
            chain.expires = now + hint.ttl_s
            self.expiry.append((chain.expires, chain.keys))

    def forget_gone(self, tracked: Collection[bytes]) -> None:
        """Drop the oldest expiries whose keys are all gone."""
        expiry = self.expiry
        while expiry and all(k not in tracked for k in expiry[0][1]):
            expiry.popleft()

    def offer(
        self, victims: VictimSet, order: _Order, chain_of: dict[bytes, Chain], now: float
    ) -> dict[int, Chain] | None:
        """Offer ``order``'s keys to ``victims`` in eviction order; return the chains whose
        reprieve that used (``{}`` for none), or ``None`` if ``victims`` is not full."""
        expired = {}
        for t, chunk in self.expiry:
            if t <= now:
                expired.update(dict.fromkeys(k for k in reversed(chunk) if k in order))
        found = bool(expired) and victims.offer_all(expired)
        spared: dict[int, Chain] = {}
        if not found:
            if self._num_spared or expired:
                found = victims.offer_all(_candidates(order, chain_of, expired, spared))
            else:  # the common case: plain LRU order, C-level iteration
                found = victims.offer_all(order)
        if not found and spared:  # too few without the reprieves: offer those too
            found = victims.offer_all(
                k for c in spared.values() for k in reversed(c.keys) if k in order
            )
            spared.clear()
        return spared if found else None

    def use_reprieves(self, spared: dict[int, Chain], order: _Order) -> None:
        """The chains ``spared`` used their reprieve: back to the most recent end."""
        for chain in spared.values():
            chain.spare = False
            self._num_spared -= 1
            deque(map(order.move_to_end, [k for k in reversed(chain.keys) if k in order]), 0)


def _candidates(
    order: _Order, chain_of: dict[bytes, Chain], skip: Collection[bytes], spared: dict[int, Chain]
) -> Iterator[bytes]:
    """Keys in LRU order, less ``skip`` and keys of chains with a reprieve left (collected
    into ``spared``)."""
    for key in order:
        if key in skip:
            continue
        chain = chain_of.get(key)
        if chain is not None and chain.spare:
            spared[id(chain)] = chain
            continue
        yield key
