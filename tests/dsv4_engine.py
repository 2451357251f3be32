"""A miniature DeepSeek-V4 serving loop over kvmgr's cache groups (test helper, not a test).

``Engine`` keeps per-request block tables of every group of a ``DeepSeekV4Layout``, allocates
blocks as requests grow, frees (and poisons) the blocks that leave a request's live window, and
runs each step's cache writers: the sliding-window insert and the c4 / indexer compressors as
torch references (:mod:`kvmgr.kernels.c128.v4_reference`), the c128 layers as step hooks
(``C128CompressorHook``, or ``C128RefHook`` for a fast reference run) registered on the
``c128_state`` group's manager of a ``DeepSeekV4Offload``, whose ``step(ctx)`` runs them and
then flushes the queued swaps. Every projection is drawn per (request, layer, position) from a
seeded generator, so two engines that compute the same positions see the same inputs whatever
their block ids. All cache memory starts as random poison, never zeros.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from kvmgr.hooks import HookReport, StepContext
from kvmgr.kernels.c128.hook import C128CompressorHook
from kvmgr.kernels.c128.reference import (
    c128_compress_ref,
    c128_state_write_ref,
    rope_cos_sin_cache,
)
from kvmgr.kernels.c128.v4_reference import (
    c4_compress_ref,
    compressor_state_write_ref,
    indexer_compress_ref,
    swa_insert_ref,
)
from kvmgr.models.deepseek_v4 import DeepSeekV4Layout, DeepSeekV4Offload, allocate_caches


def poison_(t: torch.Tensor, gen: torch.Generator) -> None:
    """Fill ``t`` with random bytes (in place)."""
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), generator=gen, dtype=torch.uint8)
    t.view(-1).view(torch.uint8).copy_(raw.to(t.device))


class C128RefHook:
    """The c128 hook's contract run by the torch references (fast on CPU)."""

    def __init__(self, *, name: str, state_cache: torch.Tensor, compressed_cache: torch.Tensor,
                 ape: torch.Tensor, norm_weight: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:  # fmt: skip
        self.name, self.state_cache, self.compressed_cache = name, state_cache, compressed_cache
        self.ape, self.norm_weight, self.cos_sin_cache = ape, norm_weight, cos_sin_cache

    def __call__(self, ctx: StepContext) -> HookReport:
        t = ctx.tensors
        c128_state_write_ref(t[f"{self.name}.kv"], t[f"{self.name}.score"], self.ape,
                             t["positions"], t["c128.state_slot_mapping"], self.state_cache)  # fmt: skip
        c128_compress_ref(self.state_cache, t["c128.state_block_table"], t["c128.req_indices"],
                          t["positions"], t["c128.slot_mapping"], self.norm_weight,
                          self.cos_sin_cache, self.compressed_cache)  # fmt: skip
        return HookReport(name=self.name)


class Model:
    """Learned weights (per layer) and per-request projections, all seeded and non-zero."""

    def __init__(self, layout: DeepSeekV4Layout, max_positions: int, seed: int, device: str) -> None:  # fmt: skip
        self.layout, self.max_positions, self.seed, self.device = (
            layout,
            max_positions,
            seed,
            device,
        )
        gen = torch.Generator().manual_seed(seed)
        d, di = layout.head_dim, layout.index_head_dim
        self.weights: dict[str, torch.Tensor] = {}
        for i, r in enumerate(layout.compress_ratios):
            if r == 4:
                self.weights[f"L{i}.ape"] = torch.randn(4, 2 * d, generator=gen)
                self.weights[f"L{i}.norm"] = 0.5 + torch.rand(d, generator=gen)
                self.weights[f"L{i}.idx_ape"] = torch.randn(4, 2 * di, generator=gen)
                self.weights[f"L{i}.idx_norm"] = 0.5 + torch.rand(di, generator=gen)
            elif r == 128:
                self.weights[f"L{i}.ape"] = torch.randn(128, d, generator=gen)
                self.weights[f"L{i}.norm"] = 0.5 + torch.rand(d, generator=gen)
        self.weights = {k: v.to(device) for k, v in self.weights.items()}
        self.cos_sin_cache = rope_cos_sin_cache(max_positions, device=device)
        self._inputs: dict[str, dict[str, torch.Tensor]] = {}

    def inputs(self, req: str) -> dict[str, torch.Tensor]:
        """Projections of every position of request ``req``: ``[max_positions, width]`` bf16."""
        if req not in self._inputs:
            digest = hashlib.blake2b(req.encode(), digest_size=4).digest()
            gen = torch.Generator().manual_seed(self.seed * 7919 + int.from_bytes(digest, "little"))
            p, d, di = self.max_positions, self.layout.head_dim, self.layout.index_head_dim
            out: dict[str, torch.Tensor] = {}
            for i, r in enumerate(self.layout.compress_ratios):
                out[f"L{i}.swa"] = torch.randn(p, d, generator=gen)
                width = {4: 2 * d, 128: d}.get(r)
                if width is not None:
                    out[f"L{i}.kv"] = torch.randn(p, width, generator=gen)
                    out[f"L{i}.score"] = 3 * torch.randn(p, width, generator=gen)
                if r == 4:
                    out[f"L{i}.idx_kv"] = torch.randn(p, 2 * di, generator=gen)
                    out[f"L{i}.idx_score"] = 3 * torch.randn(p, 2 * di, generator=gen)
            self._inputs[req] = {k: v.to(torch.bfloat16).to(self.device) for k, v in out.items()}
        return self._inputs[req]


class Request:
    """One request: its block table per group (-1: no block) and tokens computed."""

    def __init__(self, name: str, groups: list[str]) -> None:
        self.name = name
        self.num_tokens = 0
        self.tables: dict[str, list[int]] = {g: [] for g in groups}

    def block_keys(self) -> list[bytes]:
        return [hashlib.blake2b(f"{self.name}/block{i}".encode(), digest_size=16).digest()
                for i in range(len(self.tables["compressed"]))]  # fmt: skip

    def boundary_key(self, num_tokens: int) -> bytes:
        return hashlib.blake2b(f"{self.name}@{num_tokens}".encode(), digest_size=16).digest()


class Engine:
    """Block tables, allocation and the cache writers of one simulated serving loop."""

    def __init__(self, model: Model, num_blocks: dict[str, int], *, kernel_hooks: bool,
                 engine: str, seed: int) -> None:  # fmt: skip
        self.model, self.layout = model, model.layout
        self.gen = torch.Generator().manual_seed(seed)
        self.caches = allocate_caches(self.layout, num_blocks, device=model.device)
        for tensors in self.caches.values():
            for t in tensors:
                poison_(t, self.gen)
        order = {g: torch.randperm(n, generator=self.gen).tolist() for g, n in num_blocks.items()}
        self.free = order  # free block ids per group; pop() allocates
        self.requests: dict[str, Request] = {}
        self.kernel_hooks, self.engine_name, self.num_blocks = kernel_hooks, engine, num_blocks
        self.offload = self._offload()

    def _offload(self) -> DeepSeekV4Offload:
        hooks = []
        for i in self.layout.layers(128):
            names = [t.name for t in self.layout.group("compressed").tensors]
            state_names = [t.name for t in self.layout.group("c128_state").tensors]
            kw = dict(name=f"L{i}", ape=self.model.weights[f"L{i}.ape"],
                      norm_weight=self.model.weights[f"L{i}.norm"],
                      cos_sin_cache=self.model.cos_sin_cache,
                      state_cache=self.caches["c128_state"][state_names.index(f"L{i}.c128_state")],
                      compressed_cache=self.caches["compressed"][names.index(f"L{i}.c128")])  # fmt: skip
            hooks.append(C128CompressorHook(**kw) if self.kernel_hooks else C128RefHook(**kw))
        cpu = {g.name: 64 for g in self.layout.groups}
        return DeepSeekV4Offload.create(self.layout, self.caches, cpu, engine=self.engine_name,
                                        hooks={"c128_state": hooks})  # fmt: skip

    def fork(self, seed: int) -> Engine:
        """A copy with cloned caches, tables and free lists, and its own managers (not entered)."""
        twin = object.__new__(Engine)
        twin.model, twin.layout, twin.gen = (
            self.model,
            self.layout,
            torch.Generator().manual_seed(seed),
        )
        twin.caches = {g: [t.clone() for t in ts] for g, ts in self.caches.items()}
        twin.free = {g: list(ids) for g, ids in self.free.items()}
        twin.requests = {}
        for name, req in self.requests.items():
            copy = Request(name, list(req.tables))
            copy.num_tokens, copy.tables = (
                req.num_tokens,
                {g: list(t) for g, t in req.tables.items()},
            )
            twin.requests[name] = copy
        twin.kernel_hooks, twin.engine_name, twin.num_blocks = (
            self.kernel_hooks,
            self.engine_name,
            self.num_blocks,
        )
        twin.offload = twin._offload()
        return twin

    # ------------------------------------------------------------------ blocks

    def allocate(self, group: str, n: int) -> list[int]:
        return [self.free[group].pop() for _ in range(n)]

    def release(self, group: str, block_ids: list[int]) -> None:
        """Poison and free blocks (their old contents must never be read again)."""
        for t in self.caches[group]:
            for b in block_ids:
                poison_(t[b], self.gen)
        self.free[group] += block_ids

    def _grow(self, req: Request, end: int) -> None:
        for g in req.tables:
            table = req.tables[g]
            for j in self.layout.blocks_for(g, 0, end):
                if j >= len(table):
                    table.append(self.allocate(g, 1)[0])

    def _drop_dead(self, req: Request) -> None:
        """Free every window-group block wholly before the request's live start."""
        for group in self.layout.groups:
            if group.kind != "window":
                continue
            start, table = (
                self.layout.live_start(group.name, req.num_tokens),
                req.tables[group.name],
            )
            dead = [j for j in range(min(start // group.block_size, len(table))) if table[j] >= 0]
            self.release(group.name, [table[j] for j in dead])
            for j in dead:
                table[j] = -1

    def evict(self, name: str) -> Request:
        """Free (and poison) every block of a request and take it off the GPU."""
        req = self.requests.pop(name)
        for g, table in req.tables.items():
            self.release(g, [b for b in table if b >= 0])
        return req

    def install(self, req: Request, ids: dict[str, list[int]]) -> None:
        """Put a reloaded request back: its live blocks are ``ids`` (as ``blocks_at`` orders)."""
        for g in req.tables:
            blocks = self.layout.blocks_at(g, req.num_tokens)
            req.tables[g] = [-1] * blocks.start + list(ids[g])
        self.requests[req.name] = req

    # ------------------------------------------------------------------ steps

    async def step(self, work: list[tuple[str, int]], *, before_flush: Any = None) -> None:
        """One step: ``work`` = (request, new tokens); new requests start at position 0.

        ``before_flush()`` runs after the torch writers and before the managers' step (which
        runs the c128 hooks, then flushes): a swap queued there is flushed in this step.
        """
        for name, _ in work:
            self.requests.setdefault(name, Request(name, [g.name for g in self.layout.groups]))
        reqs = [self.requests[name] for name, _ in work]
        for req, (_, q) in zip(reqs, work):
            self._grow(req, req.num_tokens + q)
        ctx = self._context(reqs, [q for _, q in work])
        self._write(ctx, reqs, [q for _, q in work])
        if before_flush is not None:
            before_flush()
        await self.offload.step(ctx)
        for req, (_, q) in zip(reqs, work):
            req.num_tokens += q
            self._drop_dead(req)

    def _slots(self, group: str, reqs: list[Request], pos: torch.Tensor, req_idx: torch.Tensor,
               tokens_per_row: int = 1) -> torch.Tensor:  # fmt: skip
        """Slot of each token's row in ``group`` (``tokens_per_row`` > 1: compressed entries)."""
        size = self.layout.group(group).block_size
        width = max(len(r.tables[group]) for r in reqs)
        table = torch.tensor(
            [r.tables[group] + [-1] * (width - len(r.tables[group])) for r in reqs]
        )
        blocks = table[req_idx.cpu().long(), pos.cpu() // size]
        assert bool((blocks >= 0).all()), f"{group}: a token has no block"
        rows = size // tokens_per_row
        return (blocks * rows + (pos.cpu() % size) // tokens_per_row).to(self.model.device)

    def _table(self, group: str, reqs: list[Request]) -> torch.Tensor:
        width = max(len(r.tables[group]) for r in reqs)
        rows = [r.tables[group] + [-1] * (width - len(r.tables[group])) for r in reqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.model.device)

    def _context(self, reqs: list[Request], qlens: list[int]) -> StepContext:
        dev = self.model.device
        starts = [r.num_tokens for r in reqs]
        pos = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, qlens)]).to(dev)
        req_idx = torch.cat(
            [torch.full((q,), i, dtype=torch.int32) for i, q in enumerate(qlens)]
        ).to(dev)
        tensors: dict[str, torch.Tensor] = {"positions": pos, "req_indices": req_idx}
        groups = {g.name for g in self.layout.groups}
        if "c128_state" in groups:
            tensors["c128.state_slot_mapping"] = self._slots("c128_state", reqs, pos, req_idx)
            tensors["c128.state_block_table"] = self._table("c128_state", reqs)
            tensors["c128.req_indices"] = req_idx
            tensors["c128.slot_mapping"] = self._slots("compressed", reqs, pos, req_idx, 128)
        if "c4_state" in groups:
            tensors["c4.state_slot_mapping"] = self._slots("c4_state", reqs, pos, req_idx)
            tensors["c4.state_block_table"] = self._table("c4_state", reqs)
            tensors["c4.slot_mapping"] = self._slots("compressed", reqs, pos, req_idx, 4)
        tensors["swa.slot_mapping"] = self._slots("swa", reqs, pos, req_idx)
        for i in range(len(self.layout.compress_ratios)):  # this step's projections
            for key in ("swa", "kv", "score", "idx_kv", "idx_score"):
                parts = [self.model.inputs(req.name).get(f"L{i}.{key}") for req in reqs]
                if parts[0] is not None:
                    tensors[f"L{i}.{key}"] = torch.cat(
                        [p[s : s + q] for p, s, q in zip(parts, starts, qlens)]
                    )
        loc = np.concatenate([[0], np.cumsum(qlens)])
        return StepContext(
            num_computed_tokens=np.array(starts), query_start_loc=loc, tensors=tensors
        )

    def _write(self, ctx: StepContext, reqs: list[Request], qlens: list[int]) -> None:
        """The torch-reference writers: SWA of every layer, c4 and indexer of the CSA layers."""
        t, w, cs = ctx.tensors, self.model.weights, self.model.cos_sin_cache
        names = {g.name: [x.name for x in g.tensors] for g in self.layout.groups}
        cache = lambda g, n: self.caches[g][names[g].index(n)]  # noqa: E731
        pos = t["positions"]
        for i, r in enumerate(self.layout.compress_ratios):
            swa_insert_ref(
                t[f"L{i}.swa"], pos, t["swa.slot_mapping"], cs, cache("swa", f"L{i}.swa")
            )
            if r != 4:
                continue
            state, idx_state = (
                cache("c4_state", f"L{i}.c4_state"),
                cache("c4_state", f"L{i}.indexer_state"),
            )
            compressor_state_write_ref(t[f"L{i}.kv"], t[f"L{i}.score"], w[f"L{i}.ape"], pos,
                                       t["c4.state_slot_mapping"], state, ratio=4)  # fmt: skip
            compressor_state_write_ref(t[f"L{i}.idx_kv"], t[f"L{i}.idx_score"], w[f"L{i}.idx_ape"],
                                       pos, t["c4.state_slot_mapping"], idx_state, ratio=4)  # fmt: skip
            table, req_idx = t["c4.state_block_table"], t["req_indices"]
            c4_compress_ref(state, table, req_idx, pos, t["c4.slot_mapping"], w[f"L{i}.norm"], cs,
                            cache("compressed", f"L{i}.c4"))  # fmt: skip
            indexer_compress_ref(idx_state, table, req_idx, pos, t["c4.slot_mapping"],
                                 w[f"L{i}.idx_norm"], cs, cache("compressed", f"L{i}.indexer"))  # fmt: skip

    # ------------------------------------------------------------------ reading

    def live(self, name: str, req: Request | None = None) -> dict[str, torch.Tensor]:
        """The bytes a request still reads, per tensor: every compressed entry of ``[0, N)``
        and the window groups' rows of ``[live_start, N)``, gathered through its tables."""
        req = req or self.requests[name]
        n, out = req.num_tokens, {}
        for group in self.layout.groups:
            table = torch.tensor(req.tables[group.name])
            for spec, t in zip(group.tensors, self.caches[group.name]):
                rows_per_block = spec.block_shape[0]
                if group.kind == "prefix":
                    ratio = group.block_size // rows_per_block
                    rows = torch.arange(n // ratio)
                    block, row = table[rows // rows_per_block], rows % rows_per_block
                else:
                    p = torch.arange(self.layout.live_start(group.name, n), n)
                    block, row = table[p // group.block_size], p % group.block_size
                assert bool((block >= 0).all()), f"{spec.name}: a live row has no block"
                out[spec.name] = (
                    t[block.to(t.device), row.to(t.device)].contiguous().view(torch.uint8).cpu()
                )
        return out
