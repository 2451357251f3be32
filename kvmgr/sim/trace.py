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

import csv
import datetime
import gzip
import io
import json
import math
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from kvmgr.errors import KVMgrError

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

#: Tokens per ``hash_ids`` block in the Mooncake trace format.
TRACE_BLOCK_TOKENS = 512

_AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_AZURE_TIME = re.compile(r"^(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d+))?$")


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
        with _open_text(Path(path)) as handle:
            lines = _numbered_lines(handle)
            first = next(lines, None)
            if first is None:
                raise TraceError(name, None, None, "the trace is empty")
            if first[1].lstrip().startswith("{"):
                requests = _read_mooncake(name, first, lines, limit)
            elif first[1].strip().split(",")[:3] == list(_AZURE_HEADER):
                requests = _read_azure(name, lines, limit)
            else:
                raise TraceError(
                    name,
                    first[0],
                    None,
                    "unknown trace format (expected Mooncake "
                    "JSON lines or an Azure CSV with header "
                    f"{','.join(_AZURE_HEADER)})",
                )
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


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")  # the caller closes it; a BOM is skipped


def _numbered_lines(handle: Any) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(handle, start=1):
        if line.strip():
            yield number, line


def _read_mooncake(
    name: str, first: tuple[int, str], lines: Iterator[tuple[int, str]], limit: int | None
) -> list[TraceRequest]:
    requests = [_parse_mooncake(name, *first)]
    for number, line in lines:
        if limit is not None and len(requests) >= limit:
            break
        requests.append(_parse_mooncake(name, number, line))
    return requests[:limit]


def _parse_mooncake(name: str, number: int, line: str) -> TraceRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(name, number, None, f"invalid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise TraceError(name, number, None, f"expected a JSON object, got {type(record).__name__}")
    timestamp = _number(name, number, record, "timestamp", minimum=0)
    input_length = int(_number(name, number, record, "input_length", minimum=1, integral=True))
    output_length = int(_number(name, number, record, "output_length", minimum=1, integral=True))
    hash_ids = record.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise TraceError(name, number, "hash_ids", f"expected a list of ints, got {hash_ids!r:.60}")
    num_blocks = -(-input_length // TRACE_BLOCK_TOKENS)
    if len(hash_ids) != num_blocks:
        raise TraceError(
            name,
            number,
            "hash_ids",
            f"expected {num_blocks} ids for input_length {input_length} "
            f"({TRACE_BLOCK_TOKENS}-token blocks), got {len(hash_ids)}",
        )
    return TraceRequest(timestamp / 1000.0, input_length, output_length, tuple(hash_ids))


def _number(
    name: str,
    number: int,
    record: dict[str, Any],
    field: str,
    *,
    minimum: int,
    integral: bool = False,
) -> float:
    if field not in record:
        raise TraceError(name, number, field, "missing")
    value = record[field]
    ok = isinstance(value, int) if integral else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or not math.isfinite(value):
        kind = "an int" if integral else "a number"
        raise TraceError(name, number, field, f"expected {kind}, got {value!r}")
    if value < minimum:
        raise TraceError(name, number, field, f"expected >= {minimum}, got {value!r}")
    return float(value)


def _read_azure(
    name: str, lines: Iterator[tuple[int, str]], limit: int | None
) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    next_id = 0
    for number, line in lines:
        if limit is not None and len(requests) >= limit:
            break
        row = next(csv.reader([line]))
        if len(row) < 3:
            raise TraceError(name, number, None, f"expected 3 columns, got {len(row)}")
        arrival_s = _azure_time(name, number, row[0].strip())
        context = _azure_int(name, number, "ContextTokens", row[1])
        generated = _azure_int(name, number, "GeneratedTokens", row[2])
        num_blocks = -(-context // TRACE_BLOCK_TOKENS)
        hash_ids = tuple(range(next_id, next_id + num_blocks))  # unique: no prefix sharing
        next_id += num_blocks
        requests.append(TraceRequest(arrival_s, context, generated, hash_ids))
    return requests


def _azure_int(name: str, number: int, field: str, text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise TraceError(name, number, field, f"expected an int, got {text!r}") from None
    if value < 1:
        raise TraceError(name, number, field, f"expected >= 1, got {value}")
    return value


def _azure_time(name: str, number: int, text: str) -> float:
    match = _AZURE_TIME.match(text)
    if match is None:
        try:
            return float(text)  # plain seconds are accepted too
        except ValueError:
            raise TraceError(
                name, number, "TIMESTAMP", f"expected 'YYYY-MM-DD HH:MM:SS[.fff]', got {text!r}"
            ) from None
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    fraction = float("0." + match.group(7)) if match.group(7) else 0.0
    try:
        moment = datetime.datetime(
            year, month, day, hour, minute, second, tzinfo=datetime.timezone.utc
        )
    except ValueError as exc:
        raise TraceError(name, number, "TIMESTAMP", f"invalid date {text!r}: {exc}") from None
    return moment.timestamp() + fraction
