"""What the shared tier's worker threads do: one pipelined batch of commands to one server
(private to ``kvmgr.tiers.shared``).

Offers:
    JobResult   per-item outcomes of one batch, its redirections and the error that stopped it
    get_job     ``GET`` per key, each value received into its buffers (or into a fresh buffer)
    put_job     ``EXISTS`` per key, then ``SET key blob NX [PX ttl]`` for the absent ones
    keys_job    ``EXISTS`` or ``UNLINK`` per key
    get_part, put_part, keys_part   the same for the items of one node (``Dispatcher.run``)

Every job is blocking, runs in a worker thread, sends its whole batch in one write and reads the
replies in order (one round trip; the put's ``EXISTS`` adds one), and ends by the deadline. A
connection taken from the pool that fails before any reply is read (the server restarted since
it was used) is replaced once by a fresh one; any other failure stops the job: the items without
an outcome count as failed. ``MOVED``/``ASK`` replies are returned, not followed (the caller
sends those items to the named node).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvmgr.errors import TierError, TierUnavailableError
from kvmgr.tiers._nodes import NodePool, parse_redirect
from kvmgr.tiers._resp import ReplyError, command
from kvmgr.tiers._resp_conn import Connection

__all__ = [
    "FAILED",
    "JobResult",
    "get_job",
    "get_part",
    "keys_job",
    "keys_part",
    "put_job",
    "put_part",
]

#: the outcome of an item the job could not finish
FAILED = object()
_ASKING = command(b"ASKING")
#: a put sends once this many buffers are framed (one sendmsg's worth: ~10 blobs of 48 pages)
_SEND_BUFFERS = 512


@attrs.define
class JobResult:
    """Outcomes of one job.

    Attributes:
        outcome: one per item: the reply's value (see each job), or ``FAILED``.
        redirects: ``(item, slot, (host, port), is_ask)`` per ``MOVED``/``ASK`` reply.
        refused: other error replies (``OOM``, ``NOPERM``, ``READONLY``...), as ``ReplyError``.
        error: the tier error that stopped the job, or ``None``.
    """

    outcome: list[Any]
    redirects: list[tuple[int, int, tuple[str, int], bool]] = attrs.Factory(list)
    refused: list[ReplyError] = attrs.Factory(list)
    error: TierError | None = None


def _run(
    pool: NodePool,
    num_items: int,
    deadline: float,
    exchange: Callable[[Connection, JobResult], None],
) -> JobResult:
    result = JobResult([FAILED] * num_items)
    for attempt in (0, 1):
        try:
            conn, reused = pool.acquire(deadline)
        except TierError as exc:
            result.error = exc
            return result
        try:
            exchange(conn, result)
            return result
        except TierError as exc:
            untouched = all(o is FAILED for o in result.outcome)
            if attempt == 0 and reused and untouched and isinstance(exc, TierUnavailableError):
                continue  # a pooled connection the server dropped: once more, on a fresh one
            result.error = exc
            return result
        finally:
            pool.release(conn)
    return result  # (not reached)


def _settle(result: JobResult, item: int, reply: Any) -> Any:
    """Record an error reply (a redirection or a refusal); returns ``FAILED`` for it."""
    if not isinstance(reply, ReplyError):
        return reply
    redirect = parse_redirect(reply)
    if redirect is not None:
        result.redirects.append((item, redirect[0], redirect[1], reply.kind == "ASK"))
    else:
        result.refused.append(reply)
    return FAILED


def _asked(cmd: list[Any], asking: bool) -> list[Any]:
    """``cmd``, preceded by ``ASKING`` when it follows an ``ASK`` redirection."""
    return [*_ASKING, *cmd] if asking else cmd


def get_job(
    pool: NodePool,
    keys: Sequence[bytes],
    deadline: float,
    asking: bool,
    vectors: Sequence[Sequence[Any]] | None = None,
    check: Callable[[int], bool] | None = None,
    blob_bytes: int | None = None,
) -> JobResult:
    """``GET`` each key. With ``vectors``: value ``i`` is received into ``vectors[i]`` (exactly
    their length, ``blob_bytes`` when given, else dropped) and ``check(i)`` judges it; outcome
    ``True``/``False`` (landed and checked, or not) or ``None`` (no such key). Without: outcome
    ``bytearray`` or ``None``."""

    def exchange(conn: Connection, result: JobResult) -> None:
        out: list[Any] = []
        for key in keys:
            out += _asked(command(b"GET", key), asking)
        conn.send(out, deadline)
        for i in range(len(keys)):
            if asking:
                conn.read_reply(deadline)
            if vectors is None:
                reply = conn.read_reply(deadline)
            else:
                reply = conn.read_bulk_into(vectors[i], deadline, blob_bytes)
                if reply is True and check is not None:
                    reply = bool(check(i))
            result.outcome[i] = _settle(result, i, reply)

    return _run(pool, len(keys), deadline, exchange)


def _absent(
    conn: Connection, keys: Sequence[bytes], asking: bool, deadline: float, result: JobResult
) -> list[int]:
    """``EXISTS`` per key (one round trip): the positions the server lacks; those it holds get
    the outcome ``"present"``, failed ones ``FAILED``."""
    out = []
    for key in keys:
        out += _asked(command(b"EXISTS", key), asking)
    conn.send(out, deadline)
    todo = []
    for i in range(len(keys)):
        if asking:
            conn.read_reply(deadline)
        reply = _settle(result, i, conn.read_reply(deadline))
        if reply is FAILED:
            continue
        if reply:
            result.outcome[i] = "present"
        else:
            todo.append(i)
    return todo


def put_job(
    pool: NodePool,
    keys: Sequence[bytes],
    deadline: float,
    asking: bool,
    blobs: Sequence[Any],
    ttl_ms: int | None,
    skip_present: bool,
) -> JobResult:
    """Store ``blobs[i]`` (one buffer, sent as it is) under ``keys[i]`` unless the server has
    the key (``EXISTS`` first, one round trip, when ``skip_present``; ``SET .. NX`` in any case,
    so a key another writer set, with its TTL, is never overwritten). Outcome per item:
    ``"stored"``, ``"present"`` or ``FAILED``."""
    extra = [b"NX"] + ([b"PX", ttl_ms] if ttl_ms is not None else [])

    def exchange(conn: Connection, result: JobResult) -> None:
        todo = list(range(len(keys)))
        if skip_present:
            todo = _absent(conn, keys, asking, deadline, result)
        out = []
        for i in todo:  # sent in groups of buffers
            out += _asked(command(b"SET", keys[i], [blobs[i]], *extra), asking)
            if len(out) >= _SEND_BUFFERS:
                conn.send(out, deadline)
                out = []
        if out:
            conn.send(out, deadline)
        for i in todo:
            if asking:
                conn.read_reply(deadline)
            reply = _settle(result, i, conn.read_reply(deadline))
            if reply is not FAILED:
                result.outcome[i] = "stored" if reply is not None else "present"

    return _run(pool, len(keys), deadline, exchange)


def keys_job(
    pool: NodePool, keys: Sequence[bytes], deadline: float, asking: bool, verb: bytes
) -> JobResult:
    """``verb`` (``EXISTS`` or ``UNLINK``) per key; outcome: the integer reply."""

    def exchange(conn: Connection, result: JobResult) -> None:
        out: list[Any] = []
        for key in keys:
            out += _asked(command(verb, key), asking)
        conn.send(out, deadline)
        for i in range(len(keys)):
            if asking:
                conn.read_reply(deadline)
            result.outcome[i] = _settle(result, i, conn.read_reply(deadline))

    return _run(pool, len(keys), deadline, exchange)


# ---- the jobs as ``Dispatcher.run`` calls them: one node's part of a batch ----------------


def get_part(pool: NodePool, keys: list[bytes], positions: list[int], deadline: float, asking: bool,
         vectors: Any, check: Any, blob_bytes: int | None) -> JobResult:  # fmt: skip
    """``get_job`` of the items at ``positions`` (the ``Dispatcher``'s call for one node)."""
    sub_vectors = None if vectors is None else [vectors[p] for p in positions]
    sub_check = None if check is None else (lambda i: check(positions[i]))
    return get_job(pool, keys, deadline, asking, sub_vectors, sub_check, blob_bytes)


def put_part(pool: NodePool, keys: list[bytes], positions: list[int], deadline: float, asking: bool,
         blobs: Any, ttl_ms: int | None, skip_present: bool) -> JobResult:  # fmt: skip
    return put_job(pool, keys, deadline, asking, [blobs[p] for p in positions], ttl_ms,
                   skip_present)  # fmt: skip


def keys_part(pool: NodePool, keys: list[bytes], positions: list[int], deadline: float, asking: bool,
          verb: bytes) -> JobResult:  # fmt: skip
    return keys_job(pool, keys, deadline, asking, verb)
