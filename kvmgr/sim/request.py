"""State of one simulated request while it waits, runs, or sits preempted.

Offers:
    SimRequest      token counters, block table and the swaps a request waits for
"""

from __future__ import annotations

import attrs

from kvmgr.sim.keys import private_key
from kvmgr.sim.trace import TraceRequest

__all__ = ["SimRequest"]


@attrs.define(eq=False)
class SimRequest:
    """One request of the trace inside the simulated serving loop.

    Token positions: ``num_computed`` tokens have KV in the request's GPU blocks; ``target``
    (prompt plus tokens decoded so far) must have KV before the next decode. Logical block ``i``
    holds tokens ``[i * block_size, (i + 1) * block_size)``; blocks below ``len(keys)`` are the
    published prefix, the rest (partial prompt tail, decoded tokens) are private.

    Attributes:
        index: position in the trace (also the manager's request id).
        trace: the trace record.
        keys: published prefix keys, computed at first admission.
        block_ids: GPU block table.
        num_computed: tokens with KV now.
        num_decoded: output tokens decoded so far.
        num_loads: swaps (loads, resume) in flight; the request is not scheduled meanwhile.
        tail_tokens: tokens whose KV sits in the private tail swapped out by ``preempt``
            (``None`` when nothing is swapped out).
        jump_to: after a resume, once the prefix is recomputed up to ``len(keys)`` blocks,
            ``num_computed`` jumps here (the swapped-in tail is valid up to it); else ``None``.
        num_admissions: times admitted (more than one after preemptions).
        ttft_s: virtual seconds from arrival to the end of the first prefill, once known.
    """

    index: int
    trace: TraceRequest
    keys: list[bytes] | None = None
    block_ids: list[int] = attrs.field(factory=list)
    num_computed: int = 0
    num_decoded: int = 0
    num_loads: int = 0
    tail_tokens: int | None = None
    jump_to: int | None = None
    num_admissions: int = 0
    ttft_s: float | None = None

    @property
    def target(self) -> int:
        """Tokens that need KV before the next decode: prompt plus decoded tokens."""
        return self.trace.input_length + self.num_decoded

    @property
    def is_decoding(self) -> bool:
        """Prefill done, output not finished, nothing loading."""
        return self.num_loads == 0 and self.num_computed >= self.target

    @property
    def is_finished(self) -> bool:
        """All output tokens decoded."""
        return self.num_decoded >= self.trace.output_length

    def prefill_end(self, block_size: int) -> int:
        """Where the next prefill chunk stops: the end of the prefix while a swapped-in tail
        waits for it (``jump_to``), else ``target``."""
        if self.jump_to is not None:
            assert self.keys is not None
            return len(self.keys) * block_size
        return self.target

    def valid_tokens(self) -> int:
        """Tokens whose KV is valid in the GPU blocks, the swapped-in tail included."""
        return self.num_computed if self.jump_to is None else self.jump_to

    def private_keys(self, first: int, count: int) -> list[bytes]:
        """Fingerprint keys of private blocks ``first .. first + count - 1``."""
        return [private_key(self.index, i) for i in range(first, first + count)]

    def maybe_jump(self, block_size: int) -> None:
        """After a resume: once the prefix is recomputed and nothing loads, continue from the
        end of the swapped-in tail."""
        assert self.keys is not None
        if (
            self.jump_to is not None
            and self.num_loads == 0
            and self.num_computed >= len(self.keys) * block_size
        ):
            self.num_computed, self.jump_to = self.jump_to, None
