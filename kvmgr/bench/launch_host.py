"""``kvmgr bench launch-host``: the host cost of the kernel hooks' launch paths, without a GPU.

Offers:
    add_arguments, run      the CLI entry points

Runs on any machine, in a process of its own: Triton compiles the real kernels for ``cuda:90``
behind a stub driver and every packed launch calls a stub ``cuLaunchKernelEx`` (a C no-op through
the same ctypes path, :mod:`kvmgr.bench.stub_gpu`); the step tensors are CPU tensors and nothing
is executed. So each figure is the Python around the driver call (checks, keys, the packed
write, the ctypes call) and none of the driver's own time: on the H200 host the driver adds
5.6-7.1 us per launch (BENCHMARKS.md), measured by ``kvmgr bench mla-insert`` / ``c128`` /
``peer``, which run the same paths on the GPU.

Rows (host us per call: CPU time of the calling thread, ``time.thread_time``, so a shared machine
that deschedules the process does not inflate them; minimum and median over ``--rounds`` short
samples of ``--calls`` calls, the minimum being the figure on a busy machine):

- MLA insert, L = ``--layers``, R = 512, P = 64, bf16 rows into ``--kv-cache-dtype`` caches of
  block 64, for each ``--tokens`` T: ``grouped_mla_insert`` over ``--sets`` rotating cache sets
  (as the ``grouped`` column of ``kvmgr bench mla-insert``), over one cache set with each set's
  step tensors (a serving loop: one model's caches, new step tensors), and with the very same
  tensors every call; ``GroupedMLAInsertHook`` with ``validate=True`` per set (the ``hook``
  column), one hook over the sets' step tensors, and ``validate=False``.
- c128 compressor hook, D = 512, S = 8, one decode token at position 126 (no boundary): gated
  (the state write alone; the target row), ungated, and gated over fresh step tensors; the gate
  and the cached checks alone.
- the stub driver call alone, through kvmgr's C call (the floor every launch row includes) and
  through ctypes (the call where the C module cannot be built), and one ``HookReport.of`` (how
  the hooks build their reports).

Targets (issue 27): the public grouped function, the MLA hook and the gated c128 step at most
10 us per call on the H200 host. Here the rows say what the Python costs; add the driver's share
to compare.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvmgr.bench._options import int_list, positive_int

__all__ = ["add_arguments", "run"]

_R, _P, _BLOCK = 512, 64, 64
_D, _S = 512, 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvmgr bench launch-host``."""
    parser.add_argument(
        "--tokens", type=int_list, default="1,64,512", help="comma-separated MLA step sizes T"
    )
    parser.add_argument("--layers", type=int, default=5, help="MLA layers L")
    parser.add_argument("--sets", type=int, default=16, help="rotating MLA cache sets")
    parser.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=["auto", "fp8_e4m3"],
                        help="the MLA caches' kv_cache_dtype")  # fmt: skip
    parser.add_argument("--calls", type=int, default=256, help="calls per timed sample")
    parser.add_argument(
        "--rounds", type=positive_int, default=60, help="timed samples (min and median)"
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results as JSON")


def run(args: argparse.Namespace) -> int:
    """Install the stand-in GPU, time every row, print the table; 0 on success."""
    from kvmgr.bench import stub_gpu

    stub_gpu.install()
    rows = [*_mla_rows(args), *_c128_rows(args), *_floor_rows(args)]
    _print(rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows}, handle,
                      indent=2, default=str)  # fmt: skip
    return 0


def _timed(name: str, calls: list[Callable[[], object]], args: argparse.Namespace, bound: Callable[[], list[Any]]) -> dict[str, Any]:  # fmt: skip
    """Host us per call of ``calls`` (called in turn; the thread's CPU time), the minimum and
    median over ``--rounds`` short samples of about ``--calls`` calls each; ``bound()`` lists the
    bound launches the calls used (``packed``: every one a packed launch)."""
    repeats = max(1, args.calls // len(calls))
    for call in calls * 2:  # warm up: compile, bind
        call()
    samples = []
    for _ in range(args.rounds):
        start = time.thread_time()
        for _ in range(repeats):
            for call in calls:
                call()
        samples.append((time.thread_time() - start) * 1e6 / (repeats * len(calls)))
    launches = bound()
    packed = bool(launches) and all(b.is_packed for b in launches)
    return {"row": name, "min_us": min(samples), "median_us": statistics.median(samples), "packed": packed}  # fmt: skip


def _mla_sets(args: argparse.Namespace, num_tokens: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(num_tokens)
    fp8 = args.kv_cache_dtype == "fp8_e4m3"
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    num_blocks = -(-num_tokens // _BLOCK) + 1
    sets = []
    for _ in range(args.sets):
        rows = torch.randn(args.layers, num_tokens, _R + _P, generator=gen).bfloat16()
        sets.append({
            "kv_c": rows[..., :_R].contiguous(), "k_pe": rows[..., _R:].contiguous(),
            "caches": [torch.empty(num_blocks, _BLOCK, _R + _P, dtype=cache_dtype) for _ in range(args.layers)],
            "slots": torch.randperm(num_blocks * _BLOCK, generator=gen)[:num_tokens],
            "kwargs": {"kv_cache_dtype": args.kv_cache_dtype,
                       "kv_scales": torch.rand(args.layers, generator=gen) + 0.1 if fp8 else None},
        })  # fmt: skip
    return sets


def _mla_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvmgr.hooks import StepContext
    from kvmgr.kernels.mla.api import _MEMO, grouped_mla_insert
    from kvmgr.kernels.mla.hook import GroupedMLAInsertHook

    def grouped(s: dict[str, Any], caches: list[torch.Tensor]) -> Callable[[], None]:
        return lambda: grouped_mla_insert(s["kv_c"], s["k_pe"], caches, s["slots"], **s["kwargs"])

    def context(s: dict[str, Any]) -> StepContext:
        return StepContext(tensors={"kv_c": s["kv_c"], "k_pe": s["k_pe"], "slot_mapping": s["slots"]})  # fmt: skip

    rows = []
    for num_tokens in args.tokens:
        sets, tag = _mla_sets(args, num_tokens), f"mla T={num_tokens}"
        first = sets[0]
        hooks = [GroupedMLAInsertHook(s["caches"], **s["kwargs"]) for s in sets]
        unchecked = [GroupedMLAInsertHook(s["caches"], validate=False, **s["kwargs"]) for s in sets]
        contexts = [context(s) for s in sets]
        cases = {
            f"{args.sets} rotating cache sets (bench mla-insert: grouped)": [grouped(s, s["caches"]) for s in sets],
            "one cache set, new step tensors (a serving loop)": [grouped(s, first["caches"]) for s in sets],
            "the same tensors every call": [grouped(first, first["caches"])],
            "hook per set, validate (bench mla-insert: hook)": [lambda h=h, c=c: h(c) for h, c in zip(hooks, contexts)],
            "one hook, new step tensors": [lambda c=c, h=hooks[0]: h(c) for c in contexts],
            "hook per set, validate=False": [lambda h=h, c=c: h(c) for h, c in zip(unchecked, contexts)],
        }  # fmt: skip
        memo_bound = lambda sets=sets: [b for s in sets for b in _MEMO.insert_for(s["caches"], args.kv_cache_dtype, True).bound()]  # noqa: E731  # fmt: skip
        hook_bound = lambda hooks=hooks: [b for h in hooks for b in h._insert.bound()]  # noqa: E731
        for name, calls in cases.items():
            label = f"{tag}: {'grouped_mla_insert, ' if 'hook' not in name else ''}{name}"
            rows.append(_timed(label, calls, args, hook_bound if "hook" in name else memo_bound))
    return rows


def _c128_case(gen: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from kvmgr.kernels.c128.layout import c128_entry_bytes
    from kvmgr.kernels.c128.reference import rope_cos_sin_cache

    layer = {"state_cache": torch.randn(64, _S, 2 * _D, generator=gen),
             "compressed_cache": torch.zeros(16, 4, c128_entry_bytes(_D), dtype=torch.uint8),
             "ape": torch.randn(128, _D, generator=gen), "norm_weight": torch.rand(_D, generator=gen),
             "cos_sin_cache": rope_cos_sin_cache(4096)}  # fmt: skip
    tensors = {"positions": torch.tensor([126]), "c128.state_slot_mapping": torch.tensor([126]),
               "c128.state_block_table": torch.arange(64, dtype=torch.int32).view(1, 64),
               "c128.req_indices": torch.zeros(1, dtype=torch.int32),
               "c128.slot_mapping": torch.tensor([0]),
               "c128.kv": torch.randn(1, _D, generator=gen).bfloat16(),
               "c128.score": torch.randn(1, _D, generator=gen).bfloat16()}  # fmt: skip
    return layer, tensors


def _c128_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvmgr.hooks import StepContext
    from kvmgr.kernels.c128.gate import c128_boundary
    from kvmgr.kernels.c128.hook import C128CompressorHook

    layer, tensors = _c128_case(torch.Generator().manual_seed(128))
    meta = {"num_computed_tokens": np.array([126]), "query_start_loc": np.array([0, 1])}
    ctx = StepContext(tensors=tensors, **meta)
    gated, ungated = C128CompressorHook(**layer), C128CompressorHook(**layer, gated=False)
    fresh = [StepContext(tensors={k: v.clone() for k, v in tensors.items()}, **meta) for _ in range(16)]  # fmt: skip
    write = (tensors["c128.kv"], tensors["c128.score"], tensors["positions"], tensors["c128.state_slot_mapping"])  # fmt: skip
    cases = {
        "c128 hook step, B=1 non-boundary, gated (target row)": [lambda: gated(ctx)],
        "c128 hook step, B=1 non-boundary, ungated": [lambda: ungated(ctx)],
        "c128 hook step, gated, new step tensors": [lambda c=c: gated(c) for c in fresh],
        "c128 gate alone (c128_boundary)": [lambda: c128_boundary(meta["num_computed_tokens"], meta["query_start_loc"])],
        "c128 state write checks + arguments (prepare_write)": [lambda: gated._layer.prepare_write(*write)],
    }  # fmt: skip

    def bound() -> list[Any]:
        return [*gated._layer._write.bound(), *ungated._layer._compress.bound()]

    return [_timed(name, calls, args, bound) for name, calls in cases.items()]


def _floor_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvmgr.hooks import HookReport
    from kvmgr.kernels.launch import launcher, native

    libcuda = launcher.driver()
    assert libcuda is not None
    config = (ctypes.c_uint64 * 7)()
    call = (ctypes.c_void_p(ctypes.addressof(config)), ctypes.c_void_p(1), (ctypes.c_void_p * 4)(), None)  # fmt: skip
    fire = native.native_fire()
    record = native.Record(libcuda.launch_address or 0, call[0].value, 1, ctypes.addressof(call[2]))  # fmt: skip
    cases = {
        "stub cuLaunchKernelEx alone, through ctypes (without the C module)": [lambda: libcuda.launch(*call)],
        "stub cuLaunchKernelEx through the C call (in every launch row)": [lambda: fire(record.address)] if fire else [],
        "HookReport.of(...) (in every hook row)": [lambda: HookReport.of("x", 1, 0, 0.0, {"num_tokens": 1, "grouped": True})],
    }  # fmt: skip
    return [_timed(name, calls, args, lambda: []) for name, calls in cases.items() if calls]


def _print(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="host CPU us per call, stub driver (no GPU time; add ~5.6-7.1 us per launch on the H200 host)")  # fmt: skip
    for column in ("path", "min us", "median us", "packed"):
        table.add_column(column, justify="left" if column == "path" else "right")
    for row in rows:
        packed = "yes" if row["packed"] else "-" if "alone" in row["row"] or "(in every" in row["row"] else "NO"  # fmt: skip
        table.add_row(row["row"], f"{row['min_us']:.2f}", f"{row['median_us']:.2f}", packed)
    Console(width=150).print(table)
