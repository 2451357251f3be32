"""Request traces: loading the Mooncake JSONL format and the Azure 2023 CSV format.

Offers:
    TraceRequest        one request: arrival time, prompt and output lengths, prefix block ids
    TraceError          a malformed trace line (names the file, the line and the field)
    load_trace          read a trace file (format chosen by content; ``.gz`` accepted)
    slice_trace         a slice of a loaded trace (``--offset``: the second half, say)
    default_trace_path  the bundled Mooncake FAST'25 conversation trace
    bundled_trace_path  a bundled trace by name (``BUNDLED_TRACES``: Mooncake, Azure 2023)

Mooncake (``kvcache-ai/Mooncake``, ``FAST25-release/traces``): one JSON object per line with
``timestamp`` (ms from the trace start), ``input_length``, ``output_length`` and ``hash_ids``,
one id per ``TRACE_BLOCK_TOKENS``-token prompt block; equal ids at equal positions mean equal
prefixes. Azure LLM inference 2023: CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` without
prefix information; every request gets fresh, unique block ids so nothing is ever shared.
"""

from __future__ import annotations

import gzip
from importlib import resources
from pathlib import Path

import attrs

from kvmgr.sim.trace_formats import open_text, read_requests
from kvmgr.sim.trace_request import TRACE_BLOCK_TOKENS, TraceError, TraceRequest

__all__ = [
    "BUNDLED_TRACES",
    "TRACE_BLOCK_TOKENS",
    "TraceError",
    "TraceRequest",
    "bundled_trace_path",
    "default_trace_path",
    "load_trace",
    "slice_trace",
]

#: Traces shipped in ``kvmgr/sim/data`` (attribution in its README.md): name -> file.
BUNDLED_TRACES = {
    "mooncake-conversation": "conversation_trace.jsonl.gz",
    "azure-code": "AzureLLMInferenceTrace_code.csv.gz",
    "azure-conv": "AzureLLMInferenceTrace_conv.csv.gz",
}


def bundled_trace_path(name: str) -> Path:
    """Path of a bundled trace, by its name in ``BUNDLED_TRACES``.

    Raises:
        ValueError: unknown name (the message lists the bundled ones).
    """
    if name not in BUNDLED_TRACES:
        raise ValueError(f"unknown bundled trace {name!r}; expected one of {list(BUNDLED_TRACES)}")
    return Path(str(resources.files("kvmgr.sim") / "data" / BUNDLED_TRACES[name]))


def default_trace_path() -> Path:
    """Path of the bundled Mooncake FAST'25 conversation trace (gzip JSONL, 12,031 requests)."""
    return bundled_trace_path("mooncake-conversation")


def load_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake JSONL or Azure 2023 CSV trace, sorted by arrival (stable).

    Args:
        path: the file; a ``.gz`` suffix means gzip. The format is recognised from the first
            non-empty line (a ``{`` for JSONL, the ``TIMESTAMP,...`` header for CSV).
        limit: keep only the first ``limit`` requests of the file (``None``: all).

    Returns:
        The requests, arrival times shifted so the first request of the file arrives at 0.

    Raises:
        TraceError: the file cannot be read, is empty, has an unknown format, or a malformed
            line (the message names the file, the 1-based line number and the field).
        ValueError: ``limit`` < 1.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"expected limit >= 1 or None, got {limit}")
    name = str(path)
    try:
        with open_text(Path(path)) as handle:
            requests = read_requests(name, handle, limit)
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile) as exc:
        raise TraceError(name, None, None, f"cannot read: {exc}") from None
    if not requests:
        raise TraceError(name, None, None, "the trace holds no requests")
    start = min(r.arrival_s for r in requests)
    requests.sort(key=lambda r: r.arrival_s)
    return [attrs.evolve(r, arrival_s=r.arrival_s - start) for r in requests]


def slice_trace(
    requests: list[TraceRequest], offset: str | int | None = None, limit: int | None = None
) -> list[TraceRequest]:
    """``requests[start : start + limit]`` with arrivals shifted to start at 0.

    Args:
        requests: a loaded trace (sorted by arrival).
        offset: requests to skip: an ``int``, a numeral, or ``"P%"`` (P percent of the
            requests, rounded down; ``"50%"`` is the second half); ``None``: none.
        limit: keep at most this many (``None``: all).

    Raises:
        ValueError: a negative offset, ``P`` outside [0, 100), ``limit`` < 1, or nothing left.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"expected limit >= 1 or None, got {limit}")
    start = 0
    if isinstance(offset, str) and offset.endswith("%"):
        percent = float(offset[:-1])
        if not 0 <= percent < 100:
            raise ValueError(f"offset: expected 0 <= P < 100, got {offset!r}")
        start = int(len(requests) * percent / 100)
    elif offset is not None:
        start = int(offset)
    if start < 0:
        raise ValueError(f"offset: expected >= 0, got {offset!r}")
    part = requests[start:] if limit is None else requests[start : start + limit]
    if not part:
        raise ValueError(f"offset {offset!r}: no requests left of {len(requests)}")
    if start == 0:
        return part
    t0 = part[0].arrival_s
    return [attrs.evolve(r, arrival_s=r.arrival_s - t0) for r in part]
