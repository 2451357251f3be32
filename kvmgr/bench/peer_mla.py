"""``kvmgr bench peer`` (MLA half): the grouped MLA insert against a C++/CUDA baseline.

Offers:
    add_arguments   this half's options
    run_peer_mla    builds the baseline, checks equal output bytes, prints the table; exit code
    run             the same (``kvmgr bench peer-mla``; ``kvmgr bench peer`` runs both halves)

The baseline is a CUDA kernel written here after the published design of vLLM's
``concat_and_cache_mla_grouped`` (not its code): grid ``(T, L)``, one CTA of ``min(R, 512)``
threads per (token, layer); the CTA reads its slot, skips padding (``slot < 0``) and slots past
the capacity, then its threads stride over the ``R`` latent values and the ``P`` RoPE values of
the token and store them into ``caches[l][slot // block_size, slot % block_size]``. The layers'
cache bases come from an ``int64 [L]`` device table, as in kvmgr. ``auto`` copies the 2-byte
values; ``fp8_e4m3`` stores ``fp8(x / scale[l])`` with IEEE division and a saturating,
round-to-nearest-even conversion (``__nv_cvt_float_to_fp8(.., __NV_SATFINITE, __NV_E4M3)``),
the same arithmetic as kvmgr's kernel, so the bytes must be equal. It is compiled at run time
(nvcc, ninja and a C++ compiler; GPU machine only) as a ``torch.ops`` op, called as vLLM calls
its cache ops: :mod:`kvmgr.bench._peer_mla_op` (the sources, and a build of a few seconds into
a persistent folder, ``$KVMGR_PEER_BUILD_DIR``).

Per (kv dtype, T), L = 5, R = 512, P = 64, block size 64, bf16 inputs, random non-zero values and
caches filled with the same random bytes for both: both inserts run once and their caches must
be byte-identical, then each is timed

- eager: ``--calls`` back-to-back calls between two CUDA events, us per call (device span, the
  issue rate for small T), and the host us per call (``perf_counter`` over the same loop);
- graph: ``--calls`` calls captured in one CUDA graph, replay span per call.

kvmgr runs as :class:`~kvmgr.kernels.mla.hook.GroupedMLAInsertHook` (packed launches), the
baseline as the compiled op called from Python through ``torch.ops`` (before 2026-12-03 it was
a pybind11 function built with ``load_inline``: host figures of the two are not comparable).
Ratios are baseline / kvmgr (> 1: kvmgr faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvmgr.bench._options import int_list

__all__ = ["add_arguments", "run", "run_peer_mla"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the MLA half's options to ``parser`` (all prefixed ``--mla-``: the swap half shares it)."""
    parser.add_argument(
        "--mla-tokens", type=int_list, default="1,16,128,512,16384", help="token counts T"
    )
    parser.add_argument("--mla-layers", type=int, default=5, help="layers L (default 5)")
    parser.add_argument("--mla-kv-cache-dtypes", default="auto,fp8_e4m3", help="comma-separated")
    parser.add_argument("--mla-calls", type=int, default=200, help="calls per timed loop")
    parser.add_argument("--mla-repeats", type=int, default=7, help="timed loops (median)")
    parser.add_argument("--mla-json", metavar="PATH", default=None, help="also write JSON rows")


def run_peer_mla(args: argparse.Namespace) -> int:
    """Build the baseline, compare bytes and print the table; 0 ok, 1 bytes differ, 2 no GPU."""
    from kvmgr.bench._peer_mla_op import build_op, missing_tools

    if not torch.cuda.is_available():
        print("kvmgr bench peer: needs a CUDA GPU, and torch sees none.", file=sys.stderr)
        return 2
    missing = missing_tools()
    if missing is not None:
        print(f"kvmgr bench peer: cannot build the C++ baseline here: {missing}.", file=sys.stderr)
        return 2
    start_s = time.perf_counter()
    op = build_op()
    print(f"baseline built (or found built) in {time.perf_counter() - start_s:.1f} s")
    rows, all_equal = [], True
    for kv_cache_dtype in args.mla_kv_cache_dtypes.split(","):
        for num_tokens in args.mla_tokens:
            row = _case(op, args, kv_cache_dtype, num_tokens)
            all_equal &= row["bytes_equal"]
            rows.append(row)
    _print(rows)
    if args.mla_json:
        import json

        with open(args.mla_json, "w") as handle:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, handle, indent=2)
    return 0 if all_equal else 1


def run(args: argparse.Namespace) -> int:
    """``kvmgr bench peer-mla``: :func:`run_peer_mla`."""
    return run_peer_mla(args)


def _case(op: Any, args: argparse.Namespace, kv_cache_dtype: str, num_tokens: int) -> dict[str, Any]:  # fmt: skip
    from kvmgr.hooks import StepContext
    from kvmgr.kernels.mla.hook import GroupedMLAInsertHook

    layers, rank, rope, block = args.mla_layers, _RANK, _ROPE, _BLOCK
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    kv_c, k_pe, slots, num_blocks = _step_inputs(layers, num_tokens, gen)
    fp8 = kv_cache_dtype == "fp8_e4m3"
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    nbytes = num_blocks * block * (rank + rope) * cache_dtype.itemsize
    poison = torch.randint(0, 256, (layers, nbytes), dtype=torch.uint8, device="cuda", generator=gen)  # fmt: skip
    if fp8:  # poison without NaN bit patterns, so that equal bytes compare equal as values too
        poison &= 0x77
    shape = (num_blocks, block, rank + rope)
    ours = [poison[i].clone().view(cache_dtype).view(shape) for i in range(layers)]
    theirs = [poison[i].clone().view(cache_dtype).view(shape) for i in range(layers)]
    scales = torch.rand(layers, device="cuda", generator=gen) * 0.05 + 0.01
    ptrs = torch.tensor([c.data_ptr() for c in theirs], dtype=torch.int64, device="cuda")
    empty = torch.empty(0, device="cuda")
    hook = GroupedMLAInsertHook(ours, kv_cache_dtype=kv_cache_dtype, kv_scales=scales if fp8 else None)  # fmt: skip
    ctx = StepContext(tensors={"kv_c": kv_c, "k_pe": k_pe, "slot_mapping": slots})
    strides = (theirs[0].stride(0), theirs[0].stride(1), num_blocks * block)

    def kvmgr_call() -> None:
        hook(ctx)

    def baseline_call() -> None:
        op(kv_c, k_pe, ptrs, slots, scales if fp8 else empty, block, *strides, fp8)

    kvmgr_call()
    baseline_call()
    torch.cuda.synchronize()
    equal = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ours, theirs, strict=True))  # fmt: skip
    row: dict[str, Any] = {"kv_cache_dtype": kv_cache_dtype, "tokens": num_tokens, "bytes_equal": equal}  # fmt: skip
    for name, call in (("kvmgr", kvmgr_call), ("baseline", baseline_call)):
        row[f"{name}_eager_us"], row[f"{name}_host_us"] = _eager(call, args)
        row[f"{name}_graph_us"] = _graph(call, args)
    return row


_RANK, _ROPE, _BLOCK = 512, 64, 64  # kv_lora_rank, qk_rope_head_dim, tokens per block


def _step_inputs(
    layers: int, num_tokens: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``kv_c``, ``k_pe`` (bf16, random non-zero), the slots (shuffled, some padding) and the
    blocks they span (one spare)."""
    both = torch.randn(layers, num_tokens, _RANK + _ROPE, device="cuda", generator=gen) * 4 + 0.5
    kv_c = both[..., :_RANK].to(torch.bfloat16).contiguous()
    k_pe = both[..., _RANK:].to(torch.bfloat16).contiguous()
    num_blocks = -(-num_tokens // _BLOCK) + 1
    order = torch.randperm(num_blocks * _BLOCK, device="cuda", generator=gen)
    slots = order[:num_tokens].contiguous()
    if num_tokens >= 16:
        slots[::8] = -1  # some padding
    return kv_c, k_pe, slots, num_blocks


def _eager(call: Callable[[], None], args: argparse.Namespace) -> tuple[float, float]:
    """Median (device span us, host us) per call over loops of ``args.mla_calls`` calls."""
    device_us, host_us = [], []
    for _ in range(args.mla_repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # fmt: skip
        t0 = time.perf_counter()
        start.record()
        for _ in range(args.mla_calls):
            call()
        end.record()
        host_us.append((time.perf_counter() - t0) * 1e6 / args.mla_calls)
        end.synchronize()
        device_us.append(start.elapsed_time(end) * 1e3 / args.mla_calls)
    return statistics.median(device_us), statistics.median(host_us)


def _graph(call: Callable[[], None], args: argparse.Namespace) -> float:
    """Median replay span per call of a graph holding ``args.mla_calls`` calls."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # warm up on the capture's stream kind
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.mla_calls):
            call()
    spans = []
    for _ in range(args.mla_repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # fmt: skip
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        spans.append(start.elapsed_time(end) * 1e3 / args.mla_calls)
    return float(statistics.median(spans))


def _print(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title="grouped MLA insert, L=5 R=512 P=64 block=64 bf16: kvmgr vs C++ baseline (grid (T, L))",
        caption="eager: device span per call of back-to-back calls; host: CPU us per call; "
        "graph: replay span per call; ratio = baseline / kvmgr (> 1: kvmgr faster)",
    )  # fmt: skip
    for column in ("kv dtype", "T", "bytes equal", "eager kvmgr", "eager C++", "ratio",
                   "host kvmgr", "host C++", "ratio", "graph kvmgr", "graph C++", "ratio"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in rows:
        cells = [r["kv_cache_dtype"], str(r["tokens"]), "yes" if r["bytes_equal"] else "NO"]
        for kind in ("eager", "host", "graph"):
            ours, theirs = r[f"kvmgr_{kind}_us"], r[f"baseline_{kind}_us"]
            cells += [f"{ours:.2f}", f"{theirs:.2f}", f"{theirs / ours:.2f}x"]
        table.add_row(*cells)
    Console(width=170).print(table)
