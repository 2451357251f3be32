"""``kvmgr bench dsv4``: a DeepSeek-V4 restore point's sidecar, copied vs recomputed.

Offers:
    add_arguments, run   the CLI entry points

Runs on the GPU (``auto`` engine) or, slowly, on the CPU (host engine, torch references). For
each boundary ``N`` of ``--boundaries`` and the ``--preset`` layout (``flash``: 43 layers), the
full compressed blocks of the prefix are stored once; then, ``--repeats`` times:

- **sidecar**: ``DeepSeekV4Offload.store`` at ``N`` (which stores only what the shared prefix
  lacks: the partial compressed block and the live blocks of the window groups, SWA and both
  compressor states), request -> landed, then the load of the same blocks into other, poisoned
  GPU blocks, request -> landed; the loaded bytes must equal the stored ones (exit 1 if not).
- **recompute (lower bound)**: what rebuilding those blocks costs *given the hidden states of the
  tail tokens*: the projection GEMMs of every layer (SWA kv over the last ``W - 1`` tokens, the
  c4 / indexer compressor over the unfinished c4 window, the c128 compressor over ``N % 128``
  tokens; ``--hidden-size``, one weight per kind reused across layers), then the cache writers
  over the same tokens (the c128 state write kernel on the GPU, torch references otherwise).
  The hidden states themselves need a forward of the model over the tail, which this does not
  run: the table adds its estimate, ``2 * --active-params * tokens / (--tflops * 1e12)``, for the
  ``W - 1`` tail tokens and for ``W + (L - 1)(W - 1)`` tokens, the span whose re-run makes every
  layer's window equal to a cold run's (each layer's window reads the previous layer's).

Bytes: the sidecar's bytes are ``sum over window groups of len(blocks_at) * page_bytes`` plus the
partial compressed block; GB/s = bytes / seconds / 1e9. Times are medians, wall clock around the
awaits (GPU work synchronised).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import torch

from kvmgr.bench._options import positive_int
from kvmgr.kernels.c128.reference import c128_state_write_ref, rope_cos_sin_cache
from kvmgr.kernels.c128.v4_reference import compressor_state_write_ref, swa_insert_ref
from kvmgr.models.deepseek_v4 import DeepSeekV4Layout, DeepSeekV4Offload, allocate_caches

__all__ = ["add_arguments", "run"]

_PRESETS = {
    "flash": DeepSeekV4Layout.flash,
    "pro": DeepSeekV4Layout.pro,
    "tiny": lambda: DeepSeekV4Layout(compress_ratios=(0, 4, 128, 128), head_dim=128),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(_PRESETS), default="flash",
                        help="tiny: 4 layers of head dim 128, a smoke test")  # fmt: skip
    parser.add_argument("--boundaries", type=int, nargs="+", default=[1001, 4163, 32701],
                        help="restore points N (tokens computed)")  # fmt: skip
    parser.add_argument(
        "--repeats", type=positive_int, default=9, help="timed rounds (after one warm-up)"
    )
    parser.add_argument("--hidden-size", type=int, default=4096, help="4096 Flash, 7168 Pro")
    parser.add_argument("--active-params", type=float, default=13e9, help="13e9 Flash, 49e9 Pro")
    parser.add_argument("--tflops", type=float, default=989.0,
                        help="dense bf16 TFLOP/s for the forward estimate (H200: 989)")  # fmt: skip
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def run(args: argparse.Namespace) -> int:
    layout, device, rows, ok = asyncio.run(_main(args))
    _print(layout, args, rows, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "device": str(device), "rows": rows,
                       "restored_bit_exact": ok}, f, indent=2)  # fmt: skip
    if not ok:
        print("kvmgr bench dsv4: the loaded sidecar differs from the stored one")
    return 0 if ok else 1


def _random_(t: torch.Tensor, gen: torch.Generator) -> None:
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), generator=gen, dtype=torch.uint8)
    t.view(-1).view(torch.uint8).copy_(raw.to(t.device))


def _poison_blocks(t: torch.Tensor, ids: list[int], gen: torch.Generator) -> None:
    if ids:
        pages = t.view(torch.uint8).view(t.shape[0], -1)
        raw = torch.randint(0, 256, (len(ids), pages.shape[1]), generator=gen, dtype=torch.uint8)
        pages[ids] = raw.to(t.device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def _main(
    args: argparse.Namespace,
) -> tuple[DeepSeekV4Layout, torch.device, list[dict[str, Any]], bool]:
    layout = _PRESETS[args.preset]()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    rows, ok = [], True
    for n in args.boundaries:
        sidecar = await _sidecar(layout, n, args.repeats, device, gen)
        ok &= sidecar.pop("bit_exact")
        recompute = _recompute(layout, n, max(3, args.repeats // 3), args.hidden_size, device)
        rows.append({"N": n, **sidecar, **recompute, **_forward_estimate(layout, args)})
    return layout, device, rows, ok


class _Restore:
    """One boundary's caches, block tables and keys; stores and reloads its sidecar."""

    def __init__(self, layout: DeepSeekV4Layout, n: int, device: torch.device, gen: torch.Generator) -> None:  # fmt: skip
        self.layout, self.n, self.device, self.gen = layout, n, device, gen
        self.need = {g.name: len(layout.blocks_at(g.name, n)) for g in layout.groups}
        self.caches = allocate_caches(layout, {g: 2 * k + 1 for g, k in self.need.items()},
                                      device=device)  # fmt: skip
        for tensors in self.caches.values():
            for t in tensors:
                _random_(t, gen)
        self.full = n // layout.block_size
        self.block_keys = [b"prefix-%d-%d" % (n, i) for i in range(self.full)]
        # the live blocks are ids 0..k-1 of each group; they come back into ids k..2k-1
        self.tables = {g: [-1] * layout.blocks_at(g, n).start + list(range(k))
                       for g, k in self.need.items()}  # fmt: skip
        self.fresh = {g: list(range(k, 2 * k)) for g, k in self.need.items()}
        groups = {g.name: g for g in layout.groups}
        self.sidecar_bytes = sum(k * groups[g].page_bytes for g, k in self.need.items())
        self.sidecar_bytes -= self.full * groups["compressed"].page_bytes

    async def round(self, offload: DeepSeekV4Offload, r: int) -> tuple[float, float, bool]:
        """Store the sidecar of a new boundary key, poison, reload it elsewhere, check it."""
        boundary, full = b"boundary-%d-%d" % (self.n, r), self.full
        keys = offload.keys(self.n, self.block_keys, boundary)
        _sync(self.device)
        t0 = time.perf_counter()
        stored = offload.store(self.n, self.tables, self.block_keys, boundary)
        await offload.step()
        await stored
        t1 = time.perf_counter()
        cut = {g: full if g == "compressed" else 0 for g in keys}  # the prefix stays stored
        side = {g: (keys[g][cut[g] :], self.fresh[g][cut[g] :]) for g in keys}
        for g, (_, ids) in side.items():
            for t in self.caches[g]:
                _poison_blocks(t, ids, self.gen)
        _sync(self.device)
        t2 = time.perf_counter()
        futures = [offload.managers[g].swap_in(k, ids) for g, (k, ids) in side.items() if k]
        await offload.step()
        await asyncio.gather(*futures)
        _sync(self.device)
        t3 = time.perf_counter()
        exact = True
        for g, (k, ids) in side.items():
            src = list(range(cut[g], self.need[g]))
            for t in self.caches[g]:
                exact &= bool(torch.equal(t[ids].view(torch.uint8), t[src].view(torch.uint8)))
            offload.managers[g].invalidate(k)
        return t1 - t0, t3 - t2, exact


async def _sidecar(
    layout: DeepSeekV4Layout, n: int, repeats: int, device: torch.device, gen: torch.Generator
) -> dict[str, Any]:
    """Store + load of the restore point's sidecar at ``n`` (the prefix stored beforehand)."""
    point = _Restore(layout, n, device, gen)
    engine = "auto" if device.type == "cuda" else "host"
    cpu = {g: k + 2 for g, k in point.need.items()}
    store_s, load_s, exact = [], [], True
    async with DeepSeekV4Offload.create(layout, point.caches, cpu, engine=engine) as offload:
        mgr = offload.managers["compressed"]
        first = mgr.swap_out(list(range(point.full)), point.block_keys)
        await mgr.step()
        await first
        for r in range(repeats + 1):
            store, load, same = await point.round(offload, r)
            exact &= same
            if r:  # the first round warms up
                store_s.append(store)
                load_s.append(load)
    store, load = statistics.median(store_s), statistics.median(load_s)
    return {"sidecar_bytes": point.sidecar_bytes, "sidecar_store_us": store * 1e6,
            "sidecar_load_us": load * 1e6, "sidecar_load_gbps": point.sidecar_bytes / load / 1e9,
            "bit_exact": exact}  # fmt: skip


class _Tail:
    """The tail tokens' projections and cache writers of every layer (recompute's lower bound)."""

    def __init__(self, layout: DeepSeekV4Layout, n: int, hidden: int, device: torch.device) -> None:  # fmt: skip
        self.layout, self.device = layout, device
        d, di = layout.head_dim, layout.index_head_dim
        self.tail = {g: n - layout.live_start(g, n) for g in ("swa", "c4_state", "c128_state")}
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.h = torch.randn(self.tail["swa"], hidden, device=device, dtype=dtype)
        self.weights = {w: torch.randn(hidden, c, device=device, dtype=dtype) / hidden**0.5
                        for w, c in (("swa", d), ("c4", 4 * d), ("idx", 4 * di), ("c128", 2 * d))}  # fmt: skip
        self.pos = {g: torch.arange(n - t, n, device=device) for g, t in self.tail.items()}
        self.slots = {g: torch.arange(t, device=device) for g, t in self.tail.items()}
        self.cos_sin = rope_cos_sin_cache(n + 1, device=device)
        rows = {g: max(1, t) for g, t in self.tail.items()}
        self.swa = torch.zeros(rows["swa"], 1, layout.entry_bytes, dtype=torch.uint8, device=device)
        self.states = {"c4": torch.zeros(rows["c4_state"], 1, 4 * d, device=device),
                       "idx": torch.zeros(rows["c4_state"], 1, 4 * di, device=device),
                       "c128": torch.zeros(rows["c128_state"], 1, 2 * d, device=device)}  # fmt: skip
        self.ape = {"c4": torch.randn(4, 2 * d, device=device),
                    "idx": torch.randn(4, 2 * di, device=device),
                    "c128": torch.randn(128, d, device=device)}  # fmt: skip
        self.write128: Any = c128_state_write_ref
        if device.type == "cuda":
            from kvmgr.kernels.c128.api import c128_state_write

            self.write128 = c128_state_write

    def gemms(self) -> list[tuple[str, torch.Tensor]]:
        """Each layer's projections of its tail tokens, as (kind, [tokens, 2 x width])."""
        h, w, t = self.h, self.weights, self.tail
        out = []
        for r in self.layout.compress_ratios:
            out.append(("swa", h @ w["swa"]))
            if r == 4:
                out += [
                    ("c4", h[-t["c4_state"] :] @ w["c4"]),
                    ("idx", h[-t["c4_state"] :] @ w["idx"]),
                ]
            elif r == 128 and t["c128_state"]:
                out.append(("c128", h[-t["c128_state"] :] @ w["c128"]))
        return out

    def writers(self, out: list[tuple[str, torch.Tensor]]) -> None:
        """The cache writers over the projections (SWA insert, state writes)."""
        group = {"c4": "c4_state", "idx": "c4_state", "c128": "c128_state"}
        for kind, kv in out:
            if kind == "swa":
                swa_insert_ref(kv, self.pos["swa"], self.slots["swa"], self.cos_sin, self.swa)
                continue
            half, g = kv.shape[1] // 2, group[kind]
            args = (
                kv[:, :half],
                kv[:, half:],
                self.ape[kind],
                self.pos[g],
                self.slots[g],
                self.states[kind],
            )
            if kind == "c128":
                self.write128(*args)
            else:
                compressor_state_write_ref(*args, ratio=4)


def _recompute(layout: DeepSeekV4Layout, n: int, repeats: int, hidden: int, device: torch.device) -> dict[str, Any]:  # fmt: skip
    """Projection GEMMs + cache writers over the tail tokens (a lower bound of recompute)."""
    tail = _Tail(layout, n, hidden, device)
    gemm_s, write_s = [], []
    for r in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        out = tail.gemms()
        _sync(device)
        t1 = time.perf_counter()
        tail.writers(out)
        _sync(device)
        if r:  # the first round warms up
            gemm_s.append(t1 - t0)
            write_s.append(time.perf_counter() - t1)
    gemm, write = statistics.median(gemm_s), statistics.median(write_s)
    return {"tail_tokens": tail.tail, "recompute_gemm_us": gemm * 1e6,
            "recompute_write_us": write * 1e6, "recompute_lower_bound_us": (gemm + write) * 1e6}  # fmt: skip


def _forward_estimate(layout: DeepSeekV4Layout, args: argparse.Namespace) -> dict[str, float]:
    w, num_layers = layout.window, len(layout.compress_ratios)
    per_token_s = 2 * args.active_params / (args.tflops * 1e12)
    exact_tokens = w + (num_layers - 1) * (w - 1)
    return {"forward_tail_est_us": (w - 1) * per_token_s * 1e6,
            "forward_exact_tokens": exact_tokens,
            "forward_exact_est_us": exact_tokens * per_token_s * 1e6}  # fmt: skip


def _print(layout: DeepSeekV4Layout, args: argparse.Namespace, rows: list[dict[str, Any]], device: torch.device) -> None:  # fmt: skip
    print(f"kvmgr bench dsv4: preset {args.preset} ({len(layout.compress_ratios)} layers), "
          f"device {device}, hidden {args.hidden_size}, repeats {args.repeats}")  # fmt: skip
    print("| N | sidecar MB | store us | load us | load GB/s | recompute GEMM us | writers us "
          "| recompute >= us | recompute/load | fwd W-1 est us | fwd exact est us |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["recompute_lower_bound_us"] / r["sidecar_load_us"]
        print(f"| {r['N']} | {r['sidecar_bytes'] / 1e6:.2f} | {r['sidecar_store_us']:.0f} "
              f"| {r['sidecar_load_us']:.0f} | {r['sidecar_load_gbps']:.2f} "
              f"| {r['recompute_gemm_us']:.0f} | {r['recompute_write_us']:.0f} "
              f"| {r['recompute_lower_bound_us']:.0f} | {ratio:.2f}x "
              f"| {r['forward_tail_est_us']:.0f} | {r['forward_exact_est_us']:.0f} |")  # fmt: skip
    print(f"tail tokens per boundary (swa, c4, c128): "
          f"{[tuple(r['tail_tokens'].values()) for r in rows]}; exact re-forward spans "
          f"{rows[0]['forward_exact_tokens']} tokens")  # fmt: skip
