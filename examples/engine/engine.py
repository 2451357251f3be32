"""The serving loop: continuous batching, chunked prefill, prefix reuse and preemption via kvmgr.

Offers:
    Engine         ``await engine.run(requests)`` (requests and settings: request.py)

One iteration of ``Engine.run``: poll the futures of loads, preempts and resumes; schedule
(running requests first, then resumes, then admissions, within ``token_budget`` tokens); run
the model once over the batch; sample greedily; queue stores of the prompt blocks that became
full; then ``await mgr.step(ctx)``, which submits every swap queued in the iteration as one
batch per direction. kvmgr owns the GPU blocks (``manage_gpu_blocks=True``): every block comes
from ``mgr.allocate(req, n)``, and a block freed while a copy still reads it returns to the pool
only when that copy ends. See README.md for the reasoning.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from examples.engine.graphs import DecodeGraphs
from examples.engine.model import PagedDecoder, StepBatch
from examples.engine.request import (
    FINISHED,
    LOADING,
    PREEMPTED,
    PREEMPTING,
    RESUMING,
    RUNNING,
    WAITING,
    EngineConfig,
    EngineStats,
    Request,
    block_keys,
)
from kvmgr import LayerLoadError, OffloadManager, PoolExhaustedError, StepContext

__all__ = ["Engine", "EngineConfig", "EngineStats", "Request", "block_keys"]

_PAD = "decode-graph padding"  # the request id holding DecodeGraphs' scratch block


class Engine:
    """Serves requests on ``model`` with ``kv_caches`` managed by ``mgr`` (which must own the
    GPU blocks, ``ManagerConfig(manage_gpu_blocks=True)``, over these very tensors).

    ``on_step(mgr)`` runs after every ``mgr.step`` (tests call ``check_invariants`` there).
    """

    def __init__(
        self,
        model: PagedDecoder,
        kv_caches: list[torch.Tensor],
        mgr: OffloadManager,
        config: EngineConfig,
        on_step: Callable[[OffloadManager], None] | None = None,
    ) -> None:
        self.model, self.kv_caches, self.mgr, self.config = model, kv_caches, mgr, config
        self.device = kv_caches[0].device
        self.on_step = on_step
        self.stats = EngineStats()
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[Request] = []  # admission order; victims come from the tail
        self._stores: set[asyncio.Future[Any]] = set()  # store futures not yet resolved
        self._loads: list[tuple[Request, int]] = []  # admitted this step: (request, hit blocks)
        self._layerwise: Any = None  # this step's LayerwiseLoad (config.layerwise)
        self._layerwise_reqs: list[Request] = []
        self._graphs: DecodeGraphs | None = None
        self._t0 = 0.0

    # ------------------------------------------------------------------ the loop

    async def run(self, requests: list[Request]) -> EngineStats:
        """Serve ``requests`` to completion; returns the run's statistics."""
        arrivals = collections.deque(sorted(requests, key=lambda r: r.arrival_s))
        for req in arrivals:
            req.keys = block_keys(req.prompt, self.config.block_size)
        if self.config.decode_graphs and arrivals:
            bs = self.config.block_size
            longest = max(len(r.prompt) + r.max_new_tokens for r in arrivals)
            pad = self.mgr.allocate(_PAD, 1)  # a block only padding rows write
            self._graphs = DecodeGraphs(
                self.model, self.kv_caches, max_blocks=-(-longest // bs), pad_slot=pad[0] * bs,
                capture=self.device.type == "cuda", max_batch=self.config.max_num_seqs,
            )  # fmt: skip
        self._t0 = time.perf_counter()
        while arrivals or self.waiting or self.active:
            now = self._now()
            while arrivals and (not self.config.realtime or arrivals[0].arrival_s <= now):
                self.waiting.append(arrivals.popleft())
            self._poll()
            scheduled = self._schedule()
            ctx = self._execute(scheduled) if scheduled else StepContext()
            start = time.perf_counter()
            await self.mgr.step(ctx)
            self.stats.kvmgr_host_s += time.perf_counter() - start
            self.stats.steps += 1
            if self.on_step is not None:
                self.on_step(self.mgr)
            if not scheduled:
                await self._idle(arrivals)
        if self._stores:  # drain: the stores of the last steps land before we report
            await asyncio.wait(list(self._stores))
        if self._graphs is not None:
            self.mgr.free(_PAD)
            self._graphs = None
        self.stats.wall_s = time.perf_counter() - self._t0
        return self.stats

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    async def _idle(self, arrivals: collections.deque[Request]) -> None:
        """Nothing ran: wait for a copy to land, or for the next arrival."""
        futures = [r.pending for r in self.active if r.pending is not None]
        futures += self._stores  # a finished request's blocks return when its stores land
        if futures:
            await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
        elif arrivals:
            await asyncio.sleep(max(0.0, arrivals[0].arrival_s - self._now()))
        else:  # nothing in flight, nothing to come, nothing ran: it never would
            raise RuntimeError("no request can make progress: too few GPU blocks for one request")

    def _poll(self) -> None:
        """Apply the loads, preempts and resumes whose futures resolved."""
        for req in list(self.active):
            fut = req.pending
            if fut is None or not fut.done():
                continue
            req.pending = None
            if fut.exception() is not None:  # a failed copy: the KV is lost, recompute
                self._recompute(req)
            elif req.state == LOADING:
                req.state, req.num_computed = RUNNING, req.num_stored * self.config.block_size
            elif req.state == PREEMPTING:
                req.state, req.block_ids = PREEMPTED, []
            elif req.state == RESUMING:
                req.state = RUNNING
                req.block_ids = [block_id for _, block_id in self.mgr.block_table(req.req_id)]

    # ------------------------------------------------------------------ scheduling

    def _schedule(self) -> list[tuple[Request, int]]:
        """Pick ``(request, new_tokens)`` pairs for this step; decodes first."""
        budget, chosen, pressed = self.config.token_budget, [], False
        for req in list(self.active):
            if req.state != RUNNING or budget == 0:
                continue
            n = min(len(req.tokens) - req.num_computed, budget)
            if self._grow(req, n, chosen, may_preempt=True):
                chosen.append((req, n))
                budget -= n
            else:
                pressed = True
        if not pressed:
            for req in self.active:  # resume preempted requests before admitting new ones
                if req.state == PREEMPTED and not self._resume(req):
                    pressed = True
                    break
        while (
            not pressed and budget and self.waiting and len(self.active) < self.config.max_num_seqs
        ):
            req = self.waiting.popleft()
            if self._admit(req, budget):
                self.active.append(req)
                if req.state == RUNNING:
                    n = min(len(req.tokens) - req.num_computed, budget)
                    chosen.append((req, n))
                    budget -= n
            else:
                self.waiting.appendleft(req)
                pressed = True
        self._load_prefixes()
        chosen.sort(key=lambda rn: rn[1] != 1)  # one-token queries first: the decode path
        return chosen

    def _load_prefixes(self) -> None:
        """One ``load_many`` for every prefix hit admitted this step (one future for all)."""
        if not self._loads:
            return
        keys = [key for req, hits in self._loads for key in req.keys[:hits]]
        ids = [block for req, hits in self._loads for block in req.block_ids[:hits]]
        if self.config.layerwise:  # submitted now; this step's forward waits layer by layer
            load = self._timed(
                self.mgr.load_layerwise,
                keys,
                np.asarray(ids, dtype=np.int64),
                layers=2,
                max_groups=self.config.layer_groups,
            )
            self._layerwise, self._layerwise_reqs = load, [req for req, _ in self._loads]
            self._stores.add(load.future)  # drained at the end like the stores
            load.future.add_done_callback(self._stores.discard)
            self._loads = []
            return
        future = self._timed(self.mgr.load_many, keys, np.asarray(ids, dtype=np.int64))
        for req, _ in self._loads:
            req.pending = future
        self._loads = []

    def _admit(self, req: Request, budget: int) -> bool:
        """Start a request if its first chunk's blocks are free with one block of headroom per
        admitted request (admission never preempts): allocate, then load the cached prefix from
        the CPU tier into the first blocks (LOADING) or compute from scratch (RUNNING)."""
        bs, mgr = self.config.block_size, self.mgr
        reusable = (len(req.tokens) - 1) // bs  # keep one token to compute: it gives the logits
        hits = 0
        if self.config.offload and reusable:
            hits = self._timed(mgr.lookup, req.keys[:reusable])
        n = min(len(req.tokens) - hits * bs, budget)
        need = -(-(hits * bs + n) // bs)
        free = self._timed(mgr.statistics).gpu_blocks_free
        if free - need < len(self.active):
            return False
        try:
            req.block_ids = self._timed(mgr.allocate, req.req_id, need)
        except PoolExhaustedError:
            return False
        if not hits:
            req.state = RUNNING
            return True
        self._loads.append((req, hits))  # queued as one load_many after scheduling
        req.state, req.num_stored = LOADING, hits
        self.stats.hit_tokens += hits * bs
        if self.config.layerwise:  # computes its suffix this very step, over the loading prefix
            req.state, req.num_computed = RUNNING, hits * bs
        return True

    def _grow(
        self, req: Request, n: int, chosen: list[tuple[Request, int]], *, may_preempt: bool
    ) -> bool:
        """Give ``req`` the blocks for ``n`` more tokens; under pressure, preempt the latest
        admitted running requests not chosen this step. False: not this step."""
        bs = self.config.block_size
        need = -(-(req.num_computed + n) // bs) - len(req.block_ids)
        while need > 0:
            try:
                req.block_ids += self._timed(self.mgr.allocate, req.req_id, need)
                return True
            except PoolExhaustedError:
                if not may_preempt:
                    return False
            freeing = sum(len(r.block_ids) for r in self.active if r.state == PREEMPTING)
            if freeing >= need:
                return False  # blocks come back when the preempts in flight have landed
            taken = {id(r) for r, _ in chosen}
            victims = [
                r
                for r in self.active
                if r.state == RUNNING and r is not req and id(r) not in taken and r.block_ids
            ]
            if not victims:
                return False
            self._preempt(victims[-1])
        return True

    def _preempt(self, req: Request) -> None:
        self.stats.preemptions += 1
        if self.config.offload:
            try:
                req.pending = self._timed(self.mgr.preempt, req.req_id)
                req.state = PREEMPTING
                return
            except PoolExhaustedError:  # CPU tier full of pinned blocks: recompute instead
                pass
        self._recompute(req)

    def _recompute(self, req: Request) -> None:
        """Drop the request's KV; it re-enters the queue and recomputes its tokens."""
        self.stats.recompute_preemptions += 1
        self._timed(self.mgr.free, req.req_id)
        req.state, req.block_ids, req.num_computed, req.pending = WAITING, [], 0, None
        req.num_stored = 0
        if req in self.active:
            self.active.remove(req)
        self.waiting.appendleft(req)

    def _resume(self, req: Request) -> bool:
        try:
            req.pending = self._timed(self.mgr.resume, req.req_id)
        except PoolExhaustedError:
            return False
        req.state = RESUMING
        return True

    def _timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call a kvmgr method, adding its host time to ``stats.kvmgr_host_s``."""
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.stats.kvmgr_host_s += time.perf_counter() - start

    # ------------------------------------------------------------------ execution

    def _execute(self, chosen: list[tuple[Request, int]]) -> StepContext:
        """Run the model over the chosen requests, sample, queue stores; the step's context."""
        bs, dev = self.config.block_size, self.device
        ids, positions, slots, qsl, ctx_lens, sample_rows = [], [], [], [0], [], []
        computed = np.array([r.num_computed for r, _ in chosen], dtype=np.int64)
        for req, n in chosen:
            pos = np.arange(req.num_computed, req.num_computed + n)
            table = np.asarray(req.block_ids, dtype=np.int64)
            ids.extend(req.tokens[req.num_computed : req.num_computed + n])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            qsl.append(qsl[-1] + n)
            ctx_lens.append(req.num_computed + n)
            if req.num_computed + n == len(req.tokens):
                sample_rows.append(qsl[-1] - 1)
        width = max(len(r.block_ids) for r, _ in chosen)
        tables = np.zeros((len(chosen), width), dtype=np.int64)
        for i, (req, _) in enumerate(chosen):
            tables[i, : len(req.block_ids)] = req.block_ids
        batch = StepBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_start_loc=qsl,
            context_lens=ctx_lens,
            block_tables=torch.from_numpy(tables).to(dev),
            num_decodes=sum(1 for _, n in chosen if n == 1),
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
        )
        load, self._layerwise = self._layerwise, None
        started = time.perf_counter()
        graphs = self._graphs
        store = None
        stored_before = [(req, req.num_stored) for req, _ in chosen]
        try:
            if (
                graphs is not None
                and load is None
                and len(sample_rows) == len(chosen)
                and graphs.fits(batch)
            ):
                logits = graphs.run(batch)
                self.stats.graph_steps += 1
            else:
                if self.config.layerwise:  # this step's full prompt blocks, saved per layer
                    store = self._store_layerwise(chosen)
                logits = self.model(  # the per-layer calls count as kvmgr host time too
                    batch,
                    self.kv_caches,
                    None if load is None else functools.partial(self._timed, load.wait_layer),
                    None if store is None else functools.partial(self._timed, store.save_layer),
                )
        except LayerLoadError:  # no layer of a failed load was read: recompute those requests
            if store is not None:
                store.abort()  # its blocks' K/V is rewritten when the requests run again
            for req, num_stored in stored_before:  # and stored then
                req.num_stored = num_stored
            self.stats.layerwise_failed += 1
            for req in self._layerwise_reqs:
                self._recompute(req)
            return StepContext()  # the others' new K/V are rewritten when they run again
        next_tokens = logits.argmax(dim=-1).tolist()  # greedy; syncs with the device
        self.stats.forward_s += time.perf_counter() - started
        if load is not None:
            self.stats.layerwise_steps += 1
            self.stats.layerwise_step_s += time.perf_counter() - started
            load.batches.handle.future.add_done_callback(self._count_load)
        row = 0
        for req, n in chosen:
            is_decode = n == 1 and bool(req.output) and req.num_computed + 1 == len(req.tokens)
            req.num_computed += n
            if is_decode:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += n
            if req.num_computed == len(req.tokens):
                self._sample(req, next_tokens[row], logits[row])
                row += 1
            if len(req.output) >= req.max_new_tokens:
                req.state, req.finish_s = FINISHED, self._now()
        self._store_full_blocks([req for req, _ in chosen])
        for req, _ in chosen:  # after the store: a request's blocks must be held to be named
            if req.state == FINISHED:
                self._timed(self.mgr.free, req.req_id)
        self.active = [r for r in self.active if r.state != FINISHED]
        return StepContext(
            num_computed_tokens=computed,
            query_start_loc=np.asarray(qsl, dtype=np.int64),
            tensors={"slot_mapping": batch.slot_mapping},
            stream=torch.cuda.current_stream(dev) if dev.type == "cuda" else None,
        )

    def _count_load(self, future: Any) -> None:
        """The load's groups ended (an engine thread): add their device time."""
        if not future.cancelled() and future.exception() is None:
            self.stats.layerwise_load_s += future.result().device_s or 0.0

    def _sample(self, req: Request, token: int, logits: torch.Tensor) -> None:
        if not req.output:
            req.first_logits = logits.detach().cpu().clone()
            req.first_token_s = self._now()
        req.output.append(token)

    def _full_blocks(
        self, chosen: list[tuple[Request, int]]
    ) -> tuple[list[int], list[bytes], list[bytes | None]]:
        """The prompt blocks that are full once each request computed its ``n`` more tokens
        and are not stored yet (``req.num_stored`` advanced to them): ids, keys, parents."""
        ids: list[int] = []
        keys: list[bytes] = []
        parents: list[bytes | None] = []
        seen: set[bytes] = set()  # requests sharing a prefix in one step: store each key once
        for req, n in chosen:
            full = min(req.num_computed + n, len(req.prompt)) // self.config.block_size
            for i in range(req.num_stored, full):
                if req.keys[i] in seen:
                    continue
                seen.add(req.keys[i])
                ids.append(req.block_ids[i])
                keys.append(req.keys[i])
                parents.append(req.keys[i - 1] if i else None)
            req.num_stored = max(req.num_stored, full)
        return ids, keys, parents

    def _store_layerwise(self, chosen: list[tuple[Request, int]]) -> Any:
        """ONE ``store_layerwise`` of the prompt blocks this step's forward fills (the model
        calls ``save_layer(i)`` once layer ``i`` wrote its K/V), or ``None``: nothing to store,
        or no room (``stores_rejected``). On a failed step the caller aborts it and rolls
        ``num_stored`` back: the blocks are stored when the requests run again."""
        if not self.config.offload:
            return None
        before = [(req, req.num_stored) for req, _ in chosen]
        ids, keys, parents = self._full_blocks(chosen)
        if not keys:
            return None
        try:
            store = self._timed(
                self.mgr.store_layerwise, np.asarray(ids, dtype=np.int64), keys,
                parents=parents, layers=2, max_groups=self.config.layer_groups,
            )  # fmt: skip
        except PoolExhaustedError:  # every CPU block pinned or pending: skip these stores
            self.stats.stores_rejected += 1
            for req, num_stored in before:
                req.num_stored = num_stored
            return None
        self.stats.layerwise_stores += 1
        self._stores.add(store.future)
        store.future.add_done_callback(self._stores.discard)
        store.future.add_done_callback(_retrieved)  # an aborted store fails: nobody awaits it
        return store

    def _store_full_blocks(self, reqs: list[Request]) -> None:
        """Queue ONE ``store_many`` of the prompt blocks that became full this step, over all
        requests (a full block is never written again, so nothing waits for the future)."""
        if not self.config.offload:
            return
        ids, keys, parents = self._full_blocks([(req, 0) for req in reqs])
        if not keys:
            return
        try:
            fut = self._timed(
                self.mgr.store_many, np.asarray(ids, dtype=np.int64), keys, parents=parents
            )
        except PoolExhaustedError:  # every CPU block pinned or pending: skip these stores
            self.stats.stores_rejected += 1
            return
        if not fut.done():
            self._stores.add(fut)
            fut.add_done_callback(self._stores.discard)


def _retrieved(future: Any) -> None:
    """Read a finished future's exception (an aborted layerwise store's), so asyncio does not
    report it as never retrieved."""
    if not future.cancelled():
        future.exception()
