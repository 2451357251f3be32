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
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds (after one warm-up)")
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


async def _sidecar(
    layout: DeepSeekV4Layout, n: int, repeats: int, device: torch.device, gen: torch.Generator
) -> dict[str, Any]:
    """Store + load of the restore point's sidecar at ``n`` (the prefix stored beforehand)."""
    need = {g.name: len(layout.blocks_at(g.name, n)) for g in layout.groups}
    caches = allocate_caches(layout, {g: 2 * k + 1 for g, k in need.items()}, device=device)
    for tensors in caches.values():
        for t in tensors:
            _random_(t, gen)
    engine = "auto" if device.type == "cuda" else "host"
    cpu = {g: k + 2 for g, k in need.items()}
    full = n // layout.block_size
    block_keys = [b"prefix-%d-%d" % (n, i) for i in range(full)]
    tables = {g: list(range(k)) for g, k in need.items()}
    tables.update({g: [-1] * layout.blocks_at(g, n).start + list(range(k))
                   for g, k in need.items() if g != "compressed"})  # fmt: skip
    fresh = {g: list(range(k, 2 * k)) for g, k in need.items()}
    store_s, load_s, exact = [], [], True
    async with DeepSeekV4Offload.create(layout, caches, cpu, engine=engine) as offload:
        mgr = offload.managers["compressed"]
        first = mgr.swap_out(list(range(full)), block_keys)
        await mgr.step()
        await first
        for r in range(repeats + 1):
            boundary = b"boundary-%d-%d" % (n, r)
            keys = offload.keys(n, block_keys, boundary)
            _sync(device)
            t0 = time.perf_counter()
            stored = offload.store(n, tables, block_keys, boundary)
            await offload.step()
            await stored
            t1 = time.perf_counter()
            side = {g: (keys[g][full:], fresh[g][full:]) if g == "compressed" else (keys[g], fresh[g])
                    for g in keys}  # fmt: skip
            for g, (_, ids) in side.items():  # poison the destinations
                for t in caches[g]:
                    _poison_blocks(t, ids, gen)
            _sync(device)
            t2 = time.perf_counter()
            futures = [offload.managers[g].swap_in(k, ids) for g, (k, ids) in side.items() if k]
            await offload.step()
            await asyncio.gather(*futures)
            _sync(device)
            t3 = time.perf_counter()
            for g, (k, ids) in side.items():
                src = (
                    tables[g][full:]
                    if g == "compressed"
                    else [tables[g][i] for i in layout.blocks_at(g, n)]
                )
                for t in caches[g]:
                    exact &= bool(torch.equal(t[ids].view(torch.uint8), t[src].view(torch.uint8)))
                offload.managers[g].invalidate(k)
            if r:  # the first round warms up
                store_s.append(t1 - t0)
                load_s.append(t3 - t2)
    groups = {g.name: g for g in layout.groups}
    sidecar_bytes = sum(need[g] * groups[g].page_bytes for g in need if g != "compressed")
    sidecar_bytes += (need["compressed"] - full) * groups["compressed"].page_bytes
    store, load = statistics.median(store_s), statistics.median(load_s)
    return {"sidecar_bytes": sidecar_bytes, "sidecar_store_us": store * 1e6,
            "sidecar_load_us": load * 1e6, "sidecar_load_gbps": sidecar_bytes / load / 1e9,
            "bit_exact": exact}  # fmt: skip


def _recompute(layout: DeepSeekV4Layout, n: int, repeats: int, hidden: int, device: torch.device) -> dict[str, Any]:  # fmt: skip
    """Projection GEMMs + cache writers over the tail tokens (a lower bound of recompute)."""
    d, di = layout.head_dim, layout.index_head_dim
    tail = {g: n - layout.live_start(g, n) for g in ("swa", "c4_state", "c128_state")}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h = torch.randn(tail["swa"], hidden, device=device, dtype=dtype)
    weights = {w: torch.randn(hidden, cols, device=device, dtype=dtype) / hidden**0.5
               for w, cols in (("swa", d), ("c4", 4 * d), ("idx", 4 * di), ("c128", 2 * d))}  # fmt: skip
    pos = {g: torch.arange(n - t, n, device=device) for g, t in tail.items()}
    cs = rope_cos_sin_cache(n + 1, device=device)
    swa = torch.zeros(tail["swa"], 1, layout.entry_bytes, dtype=torch.uint8, device=device)
    c4 = torch.zeros(max(1, tail["c4_state"]), 1, 4 * d, device=device)
    idx = torch.zeros(max(1, tail["c4_state"]), 1, 4 * di, device=device)
    c128 = torch.zeros(max(1, tail["c128_state"]), 1, 2 * d, device=device)
    ape4, ape_i, ape128 = (
        torch.randn(r, c, device=device) for r, c in ((4, 2 * d), (4, 2 * di), (128, d))
    )
    write128 = c128_state_write_ref
    if device.type == "cuda":
        from kvmgr.kernels.c128.api import c128_state_write as write128

    def gemms() -> list[torch.Tensor]:
        out = []
        for r in layout.compress_ratios:
            out.append(h @ weights["swa"])
            if r == 4:
                out += [
                    h[-tail["c4_state"] :] @ weights["c4"],
                    h[-tail["c4_state"] :] @ weights["idx"],
                ]
            elif r == 128 and tail["c128_state"]:
                out.append(h[-tail["c128_state"] :] @ weights["c128"])
        return out

    def writers(out: list[torch.Tensor]) -> None:
        it = iter(out)
        for r in layout.compress_ratios:
            swa_insert_ref(next(it), pos["swa"], torch.arange(tail["swa"], device=device), cs, swa)
            if r == 4:
                slots = torch.arange(tail["c4_state"], device=device)
                kv = next(it)
                compressor_state_write_ref(
                    kv[:, : 2 * d], kv[:, 2 * d :], ape4, pos["c4_state"], slots, c4, ratio=4
                )
                kv = next(it)
                compressor_state_write_ref(
                    kv[:, : 2 * di], kv[:, 2 * di :], ape_i, pos["c4_state"], slots, idx, ratio=4
                )
            elif r == 128 and tail["c128_state"]:
                kv = next(it)
                slots = torch.arange(tail["c128_state"], device=device)
                write128(kv[:, :d], kv[:, d:], ape128, pos["c128_state"], slots, c128)

    gemm_s, write_s = [], []
    for r in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        out = gemms()
        _sync(device)
        t1 = time.perf_counter()
        writers(out)
        _sync(device)
        if r:
            gemm_s.append(t1 - t0)
            write_s.append(time.perf_counter() - t1)
    gemm, write = statistics.median(gemm_s), statistics.median(write_s)
    return {"tail_tokens": tail, "recompute_gemm_us": gemm * 1e6, "recompute_write_us": write * 1e6,
            "recompute_lower_bound_us": (gemm + write) * 1e6}  # fmt: skip


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
