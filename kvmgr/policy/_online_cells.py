"""What `OnlinePolicy` learns from: its chains, their cells (features) and reuse rates per cell.

Offers (to ``kvmgr.policy.online``):
    Chain       one chain a store brought: the unit of admission and of the outcomes learned
    cell_of     a chain's cell: ghost (2) x parent state (3) x turn (4) x gap (4) x share of its
                prefix (4) x log2 length (7) x hint (3), with its turn and depth
    CellRates   outcomes per cell, shrunk to a coarse cell (ghost x parent x hint) and that to
                the overall rate with ``PRIOR`` pseudo-outcomes; halved past 20,000 outcomes
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from kvmgr.policy.hints import StoreHint

__all__ = ["CONTINUE_S", "CellRates", "Chain", "cell_of"]

CONTINUE_S = 10.0  # chunks of one prefill within this many seconds form one chain
PRIOR = 8.0  # pseudo-outcomes pulling a cell's rate to its coarse cell's (and that to all)
_INNER = 4 * 4 * 4 * 7 * 3  # cells per (ghost, parent state)
_NUM_FINE = 2 * 3 * _INNER
_NUM_COARSE = 2 * 3 * 3


class Chain:
    """One chain a store brought (the unit of admission and of the outcomes learned)."""

    __slots__ = (
        "admitted",
        "cell",
        "end",
        "expires",
        "grown",
        "keys",
        "last",
        "open",
        "p",
        "spare",
        "start",
        "turn",
    )

    def __init__(self, cell: int, now: float, admitted: bool, turn: int = 1, end: int = 0) -> None:
        self.end = end  # depth (blocks from the root) of its last key
        self.start = now  # stored
        self.grown = now  # last chunk of its prefill stored
        self.p = 1.0  # predicted reuse rate when it was admitted or declined
        self.expires: float | None = None  # its TTL hint ran out then
        self.spare = False  # one reprieve from eviction left (predicted or hinted reuse)
        self.keys: list[bytes] = []
        self.cell = cell
        self.turn = turn  # requests of its conversation so far (1: a new conversation)
        self.last = now  # stored, or last used
        self.admitted = admitted
        self.open = True  # no outcome yet


def cell_of(
    first: bytes,
    parent: bytes | None,
    n: int,
    hint: StoreHint | None,
    now: float,
    *,
    ghost: Collection[bytes],
    tracked: Collection[bytes],
    chain_of: Mapping[bytes, Chain],
    kids: Mapping[bytes, int],
) -> tuple[int, int, int]:
    """The cell of a chain of ``n`` keys from ``first`` under ``parent``, its turn and the
    depth of its last key (``ghost``, ``tracked``, ``chain_of``, ``kids``: the policy's).

    The turn grows only when the chain extends the tip of its parent's chain for the first
    time (a conversation's next request); a chain extending a shared prefix (a block
    extended before, such as a system prompt) starts a new conversation at turn 1.
    """
    is_ghost = 1 if first in ghost else 0
    state, turn, gap, known = 0, 1, 3, 0
    if parent is not None:
        state = 1 if parent in tracked else 2 if parent in ghost else 0
        turn, gap, known = _under(chain_of.get(parent), kids.get(parent, 0), now)
    if hint is None or hint.continue_p is None:
        h = 0
    else:
        h = 1 if hint.continue_p >= 0.5 else 2
    t = min(turn, 4) - 1
    length = min(6, max(0, n.bit_length() - 1))
    share = n / (n + known)
    part = 0 if share < 0.1 else 1 if share < 0.3 else 2 if share < 0.7 else 3
    return (
        (((((is_ghost * 3 + state) * 4 + t) * 4 + gap) * 4 + part) * 7 + length) * 3 + h,
        turn,
        known + n,
    )


def _under(up: Chain | None, num_kids: int, now: float) -> tuple[int, int, int]:
    """Turn, gap bucket and depth of a chain under a key of chain ``up`` (``num_kids``: chains
    stored under that key before)."""
    if up is None:
        return 1, 3, 0
    if num_kids:
        return 1, 3, up.end
    dt = now - up.start
    return up.turn + 1, 0 if dt < 60 else 1 if dt < 240 else 2, up.end


class CellRates:
    """Reuse outcomes per cell, per coarse cell and overall; `rate` shrinks them together."""

    def __init__(self) -> None:
        self._pos = [0.0] * _NUM_FINE  # outcomes per cell: reused, all
        self._cnt = [0.0] * _NUM_FINE
        self._cpos = [0.0] * _NUM_COARSE
        self._ccnt = [0.0] * _NUM_COARSE
        self._all = [0.0, 0.0]

    def rate(self, cell: int) -> float:
        """The predicted reuse rate of a chain in ``cell`` (a fraction)."""
        coarse_cell = cell // _INNER * 3 + cell % 3
        overall = (self._all[0] + 0.5) / (self._all[1] + 1.0)
        coarse = (self._cpos[coarse_cell] + PRIOR * overall) / (self._ccnt[coarse_cell] + PRIOR)
        return (self._pos[cell] + PRIOR * coarse) / (self._cnt[cell] + PRIOR)

    def outcome(self, chain: Chain, reused: bool) -> None:
        """Close ``chain``'s trial (once; later calls change nothing)."""
        if not chain.open:
            return
        chain.open = False
        cell = chain.cell
        coarse_cell = cell // _INNER * 3 + cell % 3
        self._cnt[cell] += 1.0
        self._ccnt[coarse_cell] += 1.0
        self._all[1] += 1.0
        if reused:
            self._pos[cell] += 1.0
            self._cpos[coarse_cell] += 1.0
            self._all[0] += 1.0
        if self._all[1] > 20_000:  # forget slowly: the workload drifts
            for counts in (self._pos, self._cnt, self._cpos, self._ccnt, self._all):
                for i in range(len(counts)):
                    counts[i] *= 0.5
