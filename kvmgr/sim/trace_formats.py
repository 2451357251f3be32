"""The two trace file formats, line by line: Mooncake JSONL and Azure 2023 CSV.

Private to ``kvmgr.sim`` (``trace.load_trace`` picks the format by content). Every malformed
line raises ``TraceError`` naming the file, the line and the field.
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
from pathlib import Path
from typing import Any

from kvmgr.sim.trace_request import TRACE_BLOCK_TOKENS, TraceError, TraceRequest

__all__ = [
    "AZURE_HEADER",
    "numbered_lines",
    "open_text",
    "read_azure",
    "read_mooncake",
    "read_requests",
]

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_AZURE_TIME = re.compile(r"^(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d+))?$")


def open_text(path: Path) -> io.TextIOBase:
    """The file as text (gunzipped for ``.gz``; a UTF-8 BOM skipped); the caller closes it."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")  # the caller closes it; a BOM is skipped


def numbered_lines(handle: Any) -> Iterator[tuple[int, str]]:
    """``(1-based line number, line)`` of every non-blank line."""
    for number, line in enumerate(handle, start=1):
        if line.strip():
            yield number, line


def read_mooncake(
    name: str, first: tuple[int, str], lines: Iterator[tuple[int, str]], limit: int | None
) -> list[TraceRequest]:
    """Mooncake JSONL requests from the first line and the rest, at most ``limit``."""
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


def read_azure(
    name: str, lines: Iterator[tuple[int, str]], limit: int | None
) -> list[TraceRequest]:
    """Azure 2023 CSV requests (after the header), at most ``limit``; fresh block ids each."""
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


def read_requests(name: str, handle: Any, limit: int | None) -> list[TraceRequest]:
    """The requests of an open trace file, its format recognised from the first non-empty
    line (a ``{`` for Mooncake JSONL, the ``TIMESTAMP,...`` header for Azure CSV).

    Raises:
        TraceError: the file is empty, of an unknown format, or has a malformed line.
    """
    lines = numbered_lines(handle)
    first = next(lines, None)
    if first is None:
        raise TraceError(name, None, None, "the trace is empty")
    if first[1].lstrip().startswith("{"):
        requests = read_mooncake(name, first, lines, limit)
    elif first[1].strip().split(",")[:3] == list(AZURE_HEADER):
        requests = read_azure(name, lines, limit)
    else:
        raise TraceError(
            name,
            first[0],
            None,
            "unknown trace format (expected Mooncake "
            "JSON lines or an Azure CSV with header "
            f"{','.join(AZURE_HEADER)})",
        )
    return requests
