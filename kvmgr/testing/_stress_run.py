"""One episode of the randomized stress: a manager, a model of what every block must hold.

Private to ``kvmgr.testing``; ``kvmgr.testing.stress`` is the public entry. The model follows
the rules the docs give a serving loop (a GPU block is not written while a copy of it may run;
the key of a block names its content), so every page the manager serves can be compared with
what it must hold: key ``k``'s pages are ``content[t][k]`` in every tensor ``t``.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, deque
from typing import Any

import numpy as np
import torch

from kvmgr.errors import ClosedError, KVMgrError, PoolExhaustedError, TransferError
from kvmgr.manager import OffloadManager
from kvmgr.testing._stress_model import (
    NUM_KEYS,
    PAGES,
    ModelRequest,
    StressFailure,
    check_cpu_pages,
    check_gpu_pages,
    key_of,
    misuses,
    random_config,
    random_prompt,
    settle_moves,
)
from kvmgr.testing.clock import VirtualClock
from kvmgr.testing.faults import FaultyEngine
from kvmgr.testing.invariants import check_invariants
from kvmgr.transfer import HostEngine

__all__ = ["NUM_KEYS", "PAGES", "Episode", "StressFailure"]


class Episode:
    """One manager with a random configuration, driven by ``op()`` calls from one RNG.

    Args:
        rng: the run's random generator (configuration and operations).
        content: per tensor, uint8 ``[NUM_KEYS, page_bytes]``: what key ``k``'s pages hold.
        counts: where operations, refusals and outcomes are counted (shared by episodes).
    """

    def __init__(self, rng: random.Random, content: list[torch.Tensor], counts: Counter[str]):
        self.rng, self.content, self.counts = rng, content, counts
        num_gpu = rng.choice((12, 24, 40))
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        self.kv = [
            torch.randint(1, 255, (num_gpu, PAGES[0]), dtype=torch.uint8, generator=gen),
            torch.randint(1, 1 << 30, (num_gpu, PAGES[1] // 4), dtype=torch.int32, generator=gen),
        ]
        self.rows = [self.kv[0], self.kv[1].view(torch.uint8)]
        self.config = random_config(rng)
        fail_rate = rng.choice((0.0, 0.05, 0.2))
        refused = {rng.randrange(400) for _ in range(rng.randrange(3))}
        self.engine = FaultyEngine(
            HostEngine(), fail_rate=fail_rate, refuse_batches=refused, seed=rng.randrange(1 << 30)
        )
        self.mgr = OffloadManager(self.kv, self.config, engine=self.engine)
        self.engine.hold()
        self.reqs: dict[int, ModelRequest] = {}
        self.next_req = 0
        self.futures: list[asyncio.Future[Any]] = []
        self.load_of: dict[asyncio.Future[Any], int] = {}  # load future -> its request
        self.clock = VirtualClock()
        self.page_checks = 0
        self.op_index = 0  # the episode's operation being run (for the failure's message)
        self.log: deque[str] = deque(maxlen=40)

    # ------------------------------------------------------------------ helpers

    def _write(self, block: int, k: int) -> None:
        for rows, content in zip(self.rows, self.content):
            rows[block] = content[k]

    def _track(self, future: asyncio.Future[Any], what: str, req: ModelRequest | None = None,
               loading: tuple[int, ...] = ()) -> None:  # fmt: skip
        self.futures.append(future)

        def done(f: asyncio.Future[Any]) -> None:
            if f.cancelled():
                self.counts[f"{what}.cancelled"] += 1
                return
            error = f.exception()
            name = "ok" if error is None else type(error).__name__
            self.counts[f"{what}.{name}"] += 1
            if error is not None and not isinstance(
                error, (TransferError, ClosedError, PoolExhaustedError, KVMgrError)
            ):
                self.counts["untyped"] += 1
                self.log.append(f"untyped {what} failure: {error!r}")
            if req is not None:
                req.loaded(loading, ok=error is None)

        future.add_done_callback(done)

    def _refused(self, what: str, exc: Exception) -> None:
        if not isinstance(exc, KVMgrError):
            raise StressFailure(f"{what} raised an untyped {type(exc).__name__}: {exc}") from exc
        self.counts[f"refused.{what}.{type(exc).__name__}"] += 1

    def _pick(self, state: str) -> tuple[int, ModelRequest] | None:
        ids = [i for i, r in self.reqs.items() if r.state == state]
        if not ids:
            return None
        i = self.rng.choice(ids)
        return i, self.reqs[i]

    # ------------------------------------------------------------------ operations

    def op_new(self) -> None:
        """A new request: its cached prefix is loaded, the rest computed (written)."""
        rng, mgr = self.rng, self.mgr
        prompt = random_prompt(rng)
        length = len(prompt)
        keys = [key_of(k) for k in prompt]
        hits = mgr.lookup(keys) if rng.random() < 0.8 else mgr.peek(keys)
        rid = self.next_req
        self.next_req += 1
        try:
            blocks = mgr.allocate(rid, length)
        except KVMgrError as exc:
            self._refused("allocate", exc)
            return
        req = self.reqs[rid] = ModelRequest(prompt, blocks)
        for j in range(hits, length):
            self._write(blocks[j], prompt[j])
            req.valid[j] = True
        if hits:
            loading = tuple(range(hits))
            try:
                if rng.random() < 0.5:
                    future = mgr.swap_in(keys[:hits], blocks[:hits])
                else:
                    future = mgr.load_many(keys[:hits], np.array(blocks[:hits]))
            except KVMgrError as exc:
                self._refused("load", exc)
                return
            req.loading.update(loading)
            self._track(future, "load", req, loading)
            self.load_of[future] = rid

    def op_store(self) -> None:
        picked = self._pick("gpu")
        if picked is None:
            return
        _, req = picked
        rng = self.rng
        a = rng.randrange(len(req.blocks))
        b = rng.randint(a + 1, len(req.blocks))
        span = range(a, b)
        if any(not req.valid[j] or j in req.loading for j in span):
            return
        keys = [key_of(req.prompt[j]) for j in span]
        parents = [key_of(req.prompt[a - 1]) if a else None, *keys[:-1]]
        blocks = [req.blocks[j] for j in span]
        try:
            if rng.random() < 0.5:
                # a root span gives the default chain as None: the per-call deferred path
                future = self.mgr.swap_out(blocks, keys, None if a == 0 else parents)
            else:
                future = self.mgr.store_many(np.array(blocks), keys, parents=parents)
        except KVMgrError as exc:
            self._refused("store", exc)
            return
        self._track(future, "store")

    def op_recompute(self) -> None:
        picked = self._pick("gpu")
        if picked is not None:
            _, req = picked
            for j, ok in enumerate(req.valid):
                if not ok and j not in req.loading:
                    self._write(req.blocks[j], req.prompt[j])
                    req.valid[j] = True

    def op_preempt(self) -> None:
        picked = self._pick("gpu")
        if picked is not None and not picked[1].loading:
            self._move(*picked, "preempt")

    def op_resume(self) -> None:
        picked = self._pick("cpu")
        if picked is not None:
            self._move(*picked, "resume")

    def _move(self, rid: int, req: ModelRequest, kind: str) -> None:
        """Preempt or resume request ``rid``; it is ``moving`` until ``settle_moves`` sees the end."""
        try:
            future = self.mgr.preempt(rid) if kind == "preempt" else self.mgr.resume(rid)
        except KVMgrError as exc:
            self._refused(kind, exc)
            return
        req.state, req.kind = "moving", kind
        self._track(future, kind)

    def op_free(self) -> None:
        if not self.reqs:
            return
        rid = self.rng.choice(list(self.reqs))
        try:
            self.mgr.free(rid)
        except KVMgrError as exc:
            self._refused("free", exc)  # moving: BlockStateError
            return
        del self.reqs[rid]

    def op_cancel(self) -> None:
        """Cancel a random unresolved future (the copy runs on); a cancelled load's blocks
        hold unknown bytes until it ends, so its request is freed at once."""
        pending = [f for f in self.futures if not f.done()]
        if not pending:
            return
        future = self.rng.choice(pending)
        future.cancel()
        rid = self.load_of.pop(future, None)
        if rid is not None and rid in self.reqs:
            self.mgr.free(rid)
            del self.reqs[rid]

    def op_keys(self) -> None:
        """invalidate, clear, touch, lookup of random keys."""
        rng, mgr = self.rng, self.mgr
        keys = [key_of(rng.randrange(NUM_KEYS)) for _ in range(rng.randint(1, 6))]
        what = rng.random()
        try:
            if what < 0.5:
                mgr.invalidate(keys)
            elif what < 0.55:
                mgr.clear()
            elif what < 0.8:
                mgr.touch(keys)
            else:
                mgr.lookup(keys)
        except KVMgrError as exc:
            self._refused("invalidate", exc)

    def op_misuse(self) -> None:
        """A call that must be refused with a typed error and change nothing."""
        rng, mgr = self.rng, self.mgr
        before = mgr.snapshot()
        k = rng.randrange(NUM_KEYS)
        held = [b for r in self.reqs.values() if r.state == "gpu" for b in r.blocks]
        call = rng.choice(misuses(mgr, held, key_of(k)))
        try:
            future = call()
        except KVMgrError as exc:
            self.counts[f"misuse.{type(exc).__name__}"] += 1
        except Exception as exc:
            raise StressFailure(f"misuse raised an untyped {type(exc).__name__}: {exc}") from exc
        else:
            raise StressFailure(f"a misuse was accepted: {future!r}")
        if mgr.snapshot() != before:
            raise StressFailure("a refused call changed the manager's state")

    async def op_complete(self) -> None:
        """Let the oldest held batches run (some fail), and wait until they settled."""
        rng = self.rng
        handles = self.engine.complete_next(rng.randint(1, 4), fail=rng.random() < 0.05)
        if handles:  # their outcomes reach the manager's futures; here only their end counts
            await asyncio.gather(
                *(asyncio.wrap_future(h.future) for h in handles),  # type: ignore[arg-type]
                return_exceptions=True,
            )
        for _ in range(3):
            await asyncio.sleep(0)
        self.check_bytes()  # what just landed, before anything evicts it

    async def op_step(self) -> None:
        await self.mgr.step()
        await asyncio.sleep(0)
        self.check()

    def op_time(self) -> None:
        self.clock.advance(self.rng.choice((0.1, 1.0, 6.0)))

    # ------------------------------------------------------------------ checks

    def check(self) -> None:
        """Invariants, every READY key's CPU pages, every known GPU page of every request."""
        if len(self.futures) > 256:
            self.futures = [f for f in self.futures if not f.done()]
            self.load_of = {f: r for f, r in self.load_of.items() if not f.done()}
        check_invariants(self.mgr)
        self.check_bytes()

    def check_bytes(self) -> None:
        """Every READY key's CPU pages and every known GPU page of every request."""
        settle_moves(self.reqs, self.mgr)  # preempts and resumes that ended since
        self.page_checks += check_cpu_pages(
            self.mgr.snapshot(), self.mgr.cpu_pool.tensors, self.content
        )
        self.page_checks += check_gpu_pages(self.reqs, self.rows, self.content)
