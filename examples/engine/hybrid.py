"""A hybrid (gpt-oss / Gemma-shaped) decoder: sliding-window and full-attention layers, each kind
its own cache group, offloaded and restored through ``kvmgr.groups.GroupedManager``.

Offers:
    HybridConfig    shapes: layers alternate sliding window (even) and full attention (odd)
    HybridModel     random weights; ``forward_chunk`` runs one prefill/decode chunk over paged KV
    HybridRequest   a request's tokens, position and per-group block tables
    run_request     prefill a prompt (optionally restoring a prefix first), then decode greedily
    offload_and_continue  the same prompt decoded on the GPU only, and stored, poisoned,
                    restored and continued: the logits of both, the bytes loaded
    main            ``python -m examples.engine.hybrid``: one restore, bytes vs all-full

KV layout: per layer one K and one V tensor ``[num_blocks, block_size, num_kv_heads, head_dim]``
(float32, CPU), the sliding-window layers' tensors in group ``"swa"``, the others in
``"full"``; a block id means the same block in every tensor of its group. A sliding-window
layer's token at position ``p`` reads positions ``[p - W + 1, p]``; blocks wholly before the
window of the next token are freed as the request advances (their table entry becomes
``None``), as vLLM's hybrid allocator frees them. Attention has no RoPE: a learned position
embedding is added to the input, which is enough to make every output depend on position.
Everything is computed chunk by chunk at block boundaries, so a restored run and a run that
never left the GPU do the same arithmetic on the same shapes, and their logits agree bit for bit.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from examples.engine.request import block_keys
from kvmgr.groups import GroupedLayout, GroupedManager, GroupSpec, RestorePlan

__all__ = [
    "HybridConfig",
    "HybridModel",
    "HybridRequest",
    "OffloadRun",
    "main",
    "offload_and_continue",
    "run_request",
]


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Shapes of the toy model (float32)."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 16
    window: int = 24
    block_size: int = 8
    max_positions: int = 512

    def is_sliding(self, layer: int) -> bool:
        """Even layers use the sliding window (gpt-oss's pattern)."""
        return layer % 2 == 0

    def layout(self, *, as_full: bool = False) -> GroupedLayout:
        """The model's cache groups (``as_full``: every layer treated as full attention)."""
        page = self.block_size * self.num_heads * self.head_dim * 4
        n_swa = sum(self.is_sliding(i) for i in range(self.num_layers))
        n_full = self.num_layers - n_swa
        if as_full:
            pages = (page,) * (2 * self.num_layers)
            return GroupedLayout(
                [GroupSpec(name="all", kind="full", block_size=self.block_size, page_bytes=pages)],
                hash_block_size=self.block_size,
            )
        return GroupedLayout(
            [
                GroupSpec(
                    name="full",
                    kind="full",
                    block_size=self.block_size,
                    page_bytes=(page,) * (2 * n_full),
                ),
                GroupSpec(
                    name="swa",
                    kind="sliding_window",
                    block_size=self.block_size,
                    page_bytes=(page,) * (2 * n_swa),
                    window=self.window,
                ),
            ],
            hash_block_size=self.block_size,
        )


class HybridModel:
    """Random weights (seeded), attention-only layers with residuals.

    Args:
        config: the shapes.
        seed: the weights' seed.
    """

    def __init__(self, config: HybridConfig, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        c, inner = config, config.num_heads * config.head_dim

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / shape[0] ** 0.5

        self.config = c
        self.embed = torch.randn(c.vocab_size, c.hidden_size, generator=g)
        self.pos = torch.randn(c.max_positions, c.hidden_size, generator=g)
        self.qkv = [w(c.hidden_size, 3 * inner) for _ in range(c.num_layers)]
        self.out = [w(inner, c.hidden_size) for _ in range(c.num_layers)]
        self.head = w(c.hidden_size, c.vocab_size)

    def new_caches(self, num_blocks: int) -> dict[str, list[torch.Tensor]]:
        """Per group, K and V of each of its layers: ``[num_blocks, block_size, heads, dim]``."""
        c = self.config
        shape = (num_blocks, c.block_size, c.num_heads, c.head_dim)
        out: dict[str, list[torch.Tensor]] = {"full": [], "swa": []}
        for layer in range(c.num_layers):
            group = "swa" if c.is_sliding(layer) else "full"
            out[group] += [torch.full(shape, float("nan")), torch.full(shape, float("nan"))]
        return out

    def forward_chunk(
        self,
        tokens: list[int],
        start: int,
        tables: dict[str, list[int | None]],
        caches: dict[str, list[torch.Tensor]],
    ) -> torch.Tensor:
        """Compute positions ``[start, start + len(tokens))``: write their K/V through the
        tables, attend, return the last position's logits ``[vocab_size]``.

        Raises:
            LookupError: a position the chunk must read has no block (``None`` in its table).
        """
        c = self.config
        end = start + len(tokens)
        x = self.embed[torch.tensor(tokens)] + self.pos[start:end]
        qpos = torch.arange(start, end)[:, None]
        index = {"full": 0, "swa": 0}
        for layer in range(c.num_layers):
            group = "swa" if c.is_sliding(layer) else "full"
            k_cache, v_cache = caches[group][index[group]], caches[group][index[group] + 1]
            index[group] += 2
            q, k, v = (x @ self.qkv[layer]).view(len(tokens), 3, c.num_heads, c.head_dim).unbind(1)
            for i, p in enumerate(range(start, end)):  # write by slot
                blk = tables[group][p // c.block_size]
                if blk is None:
                    raise LookupError(f"{group} block of position {p} is not held")
                k_cache[blk, p % c.block_size], v_cache[blk, p % c.block_size] = k[i], v[i]
            lo = max(0, start - c.window + 1) if c.is_sliding(layer) else 0
            keys, values = [], []
            for p in range(lo, end):  # gather by block table
                blk = tables[group][p // c.block_size]
                if blk is None:
                    raise LookupError(f"{group} block of position {p} is not held")
                keys.append(k_cache[blk, p % c.block_size])
                values.append(v_cache[blk, p % c.block_size])
            kpos = torch.arange(lo, end)[None, :]
            mask = kpos <= qpos
            if c.is_sliding(layer):
                mask &= kpos > qpos - c.window
            kk, vv = torch.stack(keys), torch.stack(values)  # [S, heads, dim]
            scores = torch.einsum("thd,shd->hts", q, kk) / c.head_dim**0.5
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            x = (
                x
                + torch.einsum("hts,shd->thd", probs, vv).reshape(len(tokens), -1) @ self.out[layer]
            )
        return x[-1] @ self.head


@dataclasses.dataclass
class HybridRequest:
    """A request: its tokens so far and one block table per group (``None``: freed)."""

    tokens: list[int]
    tables: dict[str, list[int | None]] = dataclasses.field(
        default_factory=lambda: {"full": [], "swa": []}
    )


class _Blocks:
    """A free list of GPU block ids per group (``ids``: the ids it hands out)."""

    def __init__(self, ids: range) -> None:
        self.free = {g: list(reversed(ids)) for g in ("full", "swa")}

    def take(self, group: str) -> int:
        return self.free[group].pop()

    def give(self, group: str, blk: int | None) -> None:
        if blk is not None:
            self.free[group].append(blk)


def _grow(model: HybridModel, blocks: _Blocks, req: HybridRequest, end: int) -> None:
    """Give ``req`` blocks for every position before ``end`` in both groups."""
    need = -(-end // model.config.block_size)
    for group in ("full", "swa"):
        while len(req.tables[group]) < need:
            req.tables[group].append(blocks.take(group))


def _free_window(model: HybridModel, blocks: _Blocks, req: HybridRequest, n: int) -> None:
    """After ``n`` computed tokens, free the sliding-window blocks the next token never reads
    (those before ``GroupSpec.live_blocks(n)``)."""
    c = model.config
    for j in range(min(len(req.tables["swa"]), max(0, n - c.window + 1) // c.block_size)):
        blocks.give("swa", req.tables["swa"][j])
        req.tables["swa"][j] = None


async def run_request(
    model: HybridModel,
    caches: dict[str, list[torch.Tensor]],
    blocks: Any,
    prompt: list[int],
    num_decode: int,
    *,
    restored: int = 0,
    req: HybridRequest | None = None,
    after_chunk: Callable[[HybridRequest, int], Awaitable[None]] | None = None,
) -> tuple[HybridRequest, list[torch.Tensor]]:
    """Prefill ``prompt`` from position ``restored`` (its K/V before that already in the
    request's blocks), block by block, then decode ``num_decode`` tokens greedily.

    Args:
        after_chunk: awaited after each prefill chunk with the tokens computed, before the
            window blocks that left the window are freed (where a serving loop stores them:
            a store must complete before its GPU blocks are reused).

    Returns:
        The request, and the logits of each sampled token (``num_decode`` of them).
    """
    c = model.config
    req = req or HybridRequest(list(prompt))
    logits, pos = [], restored
    while pos < len(prompt):
        end = min(len(prompt), (pos // c.block_size + 1) * c.block_size)
        _grow(model, blocks, req, end)
        out = model.forward_chunk(prompt[pos:end], pos, req.tables, caches)
        pos = end
        if after_chunk is not None:
            await after_chunk(req, pos)
        _free_window(model, blocks, req, pos)
    for _ in range(num_decode):
        logits.append(out)
        token = int(out.argmax())
        req.tokens.append(token)
        _grow(model, blocks, req, pos + 1)
        out = model.forward_chunk([token], pos, req.tables, caches)
        pos += 1
        _free_window(model, blocks, req, pos)
    return req, logits


async def restore(
    model: HybridModel,
    mgr: GroupedManager,
    caches: dict[str, list[torch.Tensor]],
    blocks: _Blocks,
    prompt: list[int],
) -> tuple[HybridRequest, RestorePlan]:
    """Look ``prompt`` up and load its plan into fresh blocks (window blocks only for the
    sliding-window group). Returns the request (tables set up to the boundary) and the plan."""
    keys = block_keys(prompt, model.config.block_size)
    plan = mgr.lookup(keys, max_tokens=len(prompt) - 1)
    req = HybridRequest(list(prompt))
    for g, name in enumerate(("full", "swa")):
        live = plan.blocks[g]
        req.tables[name] = [blocks.take(name) if j in live else None for j in range(live.stop)]
    if plan.is_hit:
        done = mgr.load(plan, req.tables)  # type: ignore[arg-type]
        await mgr.step()
        await done
    return req, plan


@dataclasses.dataclass(frozen=True)
class OffloadRun:
    """One comparison (``offload_and_continue``).

    Attributes:
        plan: what the restore loaded.
        baseline: logits of each decoded token of the run that never left the GPU.
        restored: the same for the run restored from the CPU tier.
        all_full_bytes: bytes the same restore moves with every layer as full attention.
    """

    plan: RestorePlan
    baseline: list[torch.Tensor]
    restored: list[torch.Tensor]
    all_full_bytes: int


async def offload_and_continue(
    model: HybridModel, prompt: list[int], num_decode: int, *, after_load: Any = None
) -> OffloadRun:
    """Decode ``prompt`` twice: once on the GPU only, once stored through a ``GroupedManager``
    after its prefill, every GPU block poisoned, restored into other blocks and continued.

    Args:
        after_load: ``fn(caches, tables)`` called right after the load (negative controls).
    """
    c = model.config
    num_blocks = 2 * (-(-(len(prompt) + num_decode) // c.block_size))
    baseline_caches = model.new_caches(num_blocks)
    _, baseline = await run_request(
        model, baseline_caches, _Blocks(range(num_blocks)), prompt, num_decode
    )
    caches = model.new_caches(num_blocks)
    cpu = {"full": num_blocks, "swa": num_blocks}
    keys = block_keys(prompt, c.block_size)
    async with GroupedManager.create(c.layout(), caches, cpu) as mgr:

        async def store(req: HybridRequest, n: int) -> None:
            """Store the full blocks as they are computed (before the window frees them)."""
            stored = mgr.store(keys[: n // c.block_size], req.tables)
            await mgr.step()
            await stored

        await run_request(
            model, caches, _Blocks(range(num_blocks // 2)), prompt, 0, after_chunk=store
        )
        gen = torch.Generator().manual_seed(123)
        for tensors in caches.values():  # every GPU block now holds other requests' bytes
            for t in tensors:
                t.copy_(torch.randn(t.shape, generator=gen))
        fresh = _Blocks(range(num_blocks // 2, num_blocks))
        req, plan = await restore(model, mgr, caches, fresh, prompt)
    if after_load is not None:
        after_load(caches, req.tables)
    _, restored = await run_request(
        model, caches, fresh, prompt, num_decode, restored=plan.num_tokens, req=req
    )
    all_full = c.layout(as_full=True).groups[0].block_bytes * (plan.num_tokens // c.block_size)
    return OffloadRun(plan, baseline, restored, all_full)


async def _demo() -> None:
    c = HybridConfig()
    model = HybridModel(c)
    prompt = torch.randint(0, c.vocab_size, (75,), generator=torch.Generator().manual_seed(1))
    run = await offload_and_continue(model, prompt.tolist(), 16)
    same = all(torch.equal(a, b) for a, b in zip(run.baseline, run.restored, strict=True))
    print(
        f"prompt {len(prompt)} tokens, restored {run.plan.num_tokens}: loaded "
        f"{run.plan.num_bytes} B (window {len(run.plan.blocks[1])} of "
        f"{run.plan.num_tokens // c.block_size} sliding-window blocks) vs "
        f"{run.all_full_bytes} B with every layer as full attention; 16 decoded tokens' logits "
        f"{'equal' if same else 'DIFFER from'} the run that never left the GPU"
    )


def main() -> None:
    """``python -m examples.engine.hybrid``: store a prompt, restore it, print the bytes."""
    asyncio.run(_demo())


if __name__ == "__main__":
    main()
