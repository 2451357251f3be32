"""How one shared-tier call runs: route keys to servers, run one job per server in worker
threads, follow redirections, account for failures (private to ``kvmgr.tiers.shared``).

Offers:
    Dispatcher   ``await run(keys, job, deadline_s, what)`` -> one outcome per key

Flow of ``run``: with a cluster, refresh the slot map if it is stale (at most every 0.1 s), then
group the keys by the primary of their slot; a single server gets all of them. Each group whose
server's breaker admits the call becomes a job in the worker pool; the others fail fast. The
event loop waits for every job (``join_worker``: a cancelled call returns only after its jobs
let go of their buffers; a job that raises ends the call only once the others have ended too).
``MOVED`` items go to the named node (the slot map learns it), ``ASK`` items once more with
``ASKING``; at most two rounds of redirection. A job's error trips its
server's breaker (as ``Breaker.failed`` decides), is counted and becomes the call's error if no
key got an outcome; otherwise the failed keys are plain misses (a cluster node down costs only
its keys).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import attrs

from kvmgr.errors import TierError, TierFullError, TierTimeoutError, TierUnavailableError
from kvmgr.tiers._nodes import Breaker, NodePool, SlotMap
from kvmgr.tiers._resp import Endpoint, ReplyError
from kvmgr.tiers._shared_io import FAILED, JobResult
from kvmgr.tiers.base import TierCounters, join_worker

__all__ = ["Dispatcher"]

_REFRESH_EVERY_S = 0.1
_ROUNDS = 3  # the first try and two rounds of redirection
_SINGLE = ("", 0)


@attrs.define(eq=False)
class Dispatcher:
    """Routes the calls of one ``SharedTier`` (see the module docstring).

    Args (positional, as ``SharedTier`` builds it):
        endpoint: the server (a cluster: its seed; ``Endpoint.at`` reaches the other nodes).
        make_breaker: a new server's ``Breaker``.
        max_connections: connections per server's pool.
        slots: the cluster's slot map; ``None`` for one server.
        executor: the worker pool the jobs run in.
        counters: the tier's counters (failures, redirections).
        url: the server URL without credentials (for messages).
    """

    _endpoint: Endpoint
    _make_breaker: Callable[[], Breaker]
    _max_connections: int
    _slots: SlotMap | None
    _executor: Executor
    _counters: TierCounters
    _url: str
    _pools: dict[tuple[str, int], NodePool] = attrs.field(factory=dict, init=False)
    closed: bool = attrs.field(default=False, init=False)

    def pool(self, address: tuple[str, int]) -> NodePool:
        """The pool of one server (created on first use)."""
        pool = self._pools.get(address)
        if pool is None:
            endpoint = self._endpoint if address == _SINGLE else self._endpoint.at(*address)
            pool = NodePool(endpoint, self._max_connections, self._make_breaker())
            self._pools[address] = pool
        return pool

    def close(self) -> None:
        """Close every pool's idle connections."""
        for pool in self._pools.values():
            pool.close()

    async def run(self, keys: list[bytes], job: Callable[..., JobResult], deadline_s: float,
                  what: str) -> list[Any]:  # fmt: skip
        """Run ``job(pool, keys, positions, deadline, asking)`` per server; one outcome per key
        (``FAILED`` where none).

        Raises:
            TierUnavailableError: closed, or every server involved is failing fast.
            TierError: every key failed (the first error of the call, typed).
        """
        if self.closed:
            raise TierUnavailableError(f"{what}: SharedTier is closed")
        deadline = time.monotonic() + deadline_s
        outcome: list[Any] = [FAILED] * len(keys)
        errors: list[TierError] = []
        groups = await self._route(keys, deadline, errors, what)
        for _round in range(_ROUNDS):
            launched = self._launch(groups, keys, job, deadline, errors, what)
            if not launched:
                break
            results = await _join(launched)
            groups = {}
            for (pool, positions, _future), result in zip(launched, results):
                self._account(pool, result, errors, what)
                for i, value in enumerate(result.outcome):
                    if value is not FAILED:
                        outcome[positions[i]] = value
                for i, slot, address, is_ask in result.redirects:
                    self._counters.num_redirects += 1
                    if not is_ask and self._slots is not None:
                        self._slots.moved(slot, address)
                    groups.setdefault((address, is_ask), []).append(positions[i])
            if not groups:
                break
        if errors and all(v is FAILED for v in outcome):
            raise errors[0]
        return outcome

    def _launch(
        self,
        groups: dict[tuple[tuple[str, int], bool], list[int]],
        keys: list[bytes],
        job: Callable[..., JobResult],
        deadline: float,
        errors: list[TierError],
        what: str,
    ) -> list[tuple[NodePool, list[int], asyncio.Future[JobResult]]]:
        """Submit one job per group whose server's breaker admits it; fail the others fast."""
        launched = []
        for (address, asking), positions in groups.items():
            pool = self.pool(address)
            if not pool.breaker.admit():
                self._counters.num_fail_fast += 1
                message = f"{what} on {self._url}: server {pool.endpoint.address} unreachable"
                self._fail(TierUnavailableError(message + " (backing off)"), errors)
                continue
            sub = [keys[p] for p in positions]
            future = self._executor.submit(job, pool, sub, positions, deadline, asking)
            launched.append((pool, positions, asyncio.wrap_future(future)))
        return launched

    async def _route(
        self, keys: list[bytes], deadline: float, errors: list[TierError], what: str
    ) -> dict[tuple[tuple[str, int], bool], list[int]]:
        if self._slots is None:
            return {(_SINGLE, False): list(range(len(keys)))}
        slots = self._slots
        if slots.stale and time.monotonic() - slots.refreshed_at > _REFRESH_EVERY_S:
            future = self._executor.submit(slots.refresh, self.pool, deadline)
            if not await join_worker(asyncio.wrap_future(future)) and not slots.nodes:
                self._fail(
                    TierUnavailableError(f"{what} on {self._url}: no cluster node answered"),
                    errors,
                )
        groups: dict[tuple[tuple[str, int], bool], list[int]] = {}
        for position, owner in enumerate(slots.owners(keys)):
            if owner is not None:
                groups.setdefault((owner, False), []).append(position)
        return groups

    def _account(self, pool: NodePool, result: JobResult, errors: list[TierError],
                 what: str) -> None:  # fmt: skip
        if result.error is not None:
            pool.breaker.failed(result.error)
            if self._slots is not None:
                self._slots.stale = True  # a node failed: it may have failed over
            self._fail(type(result.error)(f"{what} on {self._url}: {result.error}"), errors)
        else:
            pool.breaker.succeeded()
        if result.refused:
            self._fail(_refusal(result.refused[0], f"{what} on {self._url}"), errors)
            if self._slots is not None and result.refused[0].kind in ("READONLY", "CLUSTERDOWN"):
                self._slots.stale = True

    def _fail(self, error: TierError, errors: list[TierError]) -> None:
        """Count ``error`` and keep it for the call."""
        if isinstance(error, TierTimeoutError):
            self._counters.num_timeouts += 1
        elif isinstance(error, TierFullError):
            self._counters.num_full += 1
        else:
            self._counters.num_errors += 1
        self._counters.last_error = str(error)
        errors.append(error)


async def _join(launched: list[tuple[NodePool, list[int], asyncio.Future[JobResult]]]) -> list[JobResult]:  # fmt: skip
    """Every launched job's result once all have ended, also when one raised (a bare gather
    fails at the first error while the other jobs still read or write their rows); then the
    first error, if any."""
    results = await join_worker(
        asyncio.gather(*(f for _p, _q, f in launched), return_exceptions=True)
    )
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _refusal(reply: ReplyError, where: str) -> TierError:
    """The typed error of a server's error reply (messages carry no secrets)."""
    if reply.kind == "OOM":
        return TierFullError(f"{where}: server out of memory (maxmemory, noeviction)")
    if reply.kind in ("NOAUTH", "WRONGPASS"):
        return TierUnavailableError(f"{where}: authentication failed ({reply.kind})")
    if reply.kind == "NOPERM":
        return TierError(f"{where}: refused by the server's ACL: {reply.text[:120]}")
    if reply.kind in ("LOADING", "CLUSTERDOWN", "MASTERDOWN", "TRYAGAIN", "READONLY"):
        return TierUnavailableError(f"{where}: {reply.text[:120]}")
    return TierError(f"{where}: {reply.text[:120]}")
