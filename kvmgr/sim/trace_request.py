"""One request of a trace (``TraceRequest``) and the error a malformed trace raises.

Offers:
    TraceRequest        one request: arrival time, prompt and output lengths, prefix block ids
    TraceError          a malformed trace line (names the file, the line and the field)
    TRACE_BLOCK_TOKENS  tokens per prefix block id

``kvmgr.sim.trace`` re-exports all three with the loaders.
"""

from __future__ import annotations

import attrs

from kvmgr.errors import KVMgrError

__all__ = ["TRACE_BLOCK_TOKENS", "TraceError", "TraceRequest"]

#: Tokens per ``hash_ids`` block in the Mooncake trace format.
TRACE_BLOCK_TOKENS = 512


class TraceError(KVMgrError, ValueError):
    """A trace file is unreadable or has a malformed line.

    Attributes:
        path: the file. line: 1-based line number, or ``None`` for the whole file.
        field: the offending field, or ``None``.
    """

    def __init__(self, path: str, line: int | None, field: str | None, problem: str) -> None:
        where = path if line is None else f"{path}:{line}"
        what = f"field {field!r}: " if field else ""
        super().__init__(f"{where}: {what}{problem}")
        self.path = path
        self.line = line
        self.field = field


@attrs.frozen(slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: arrival time, seconds after the first request of the trace.
        input_length: prompt tokens (>= 1).
        output_length: tokens to generate (>= 1).
        hash_ids: one id per ``TRACE_BLOCK_TOKENS``-token prompt block (the last may be
            partial); equal ids at equal positions mean equal prefixes.
    """

    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def num_full_trace_blocks(self) -> int:
        """Prompt blocks of ``TRACE_BLOCK_TOKENS`` that are full (only these are reusable)."""
        return self.input_length // TRACE_BLOCK_TOKENS
