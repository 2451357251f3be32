"""``kvmgr bench c128``: the c128 compressor step, gated vs ungated, eager and CUDA graph.

Offers:
    add_arguments, run      the CLI entry points

Cases (head dim 512, state block size 8, bf16 ``kv``/``score``, random non-zero data):

- **non-boundary decode step** (``--batch`` requests, one token each at position 126):
  eager ``C128CompressorHook`` gated (state write only) vs ungated (state write + compress), and
  the same under CUDA graphs, where "gated" is a graph captured for a step known to be
  non-boundary (the state write alone) and "ungated" also holds the compress launch.
- **boundary decode step** (position 127): both variants launch both kernels.
- **prefill** of 1..1024 tokens of one request from position 0: device time of each kernel.

Eager steps are launch-bound: each timed run issues ``--steps`` steps back to back between two
CUDA events, so the device span is the issue rate; graph steps replay a captured graph the same
way. Kernel rows use ``triton.testing.do_bench`` (median device time). Every figure is the median
of ``--repeats`` runs after ``--warmup``. Bytes: state write ``T * (2*D*2 + D*4 + 2*D*4)``
(bf16 in, ape, fp32 row out); compress ``B * (128 * 2*D*4 + 584)`` for ``B`` boundary tokens;
GB/s = bytes / device seconds / 1e9.

Targets (the upstream change this follows): gated non-boundary step >= 3x faster than ungated
eager (51.7 us -> 17.0 us), >= 1.8x under CUDA graphs (6.15 us -> 3.36 us).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvmgr.hooks import StepContext
from kvmgr.kernels.c128 import c128_compress, c128_entry_bytes, c128_state_write
from kvmgr.kernels.c128_hook import C128CompressorHook
from kvmgr.kernels.c128_ref import c128_compress_ref, c128_unpack, rope_cos_sin_cache

__all__ = ["add_arguments", "run"]

_D = 512
_STATE_BLOCK = 8
_TARGETS = {"eager": 3.0, "graph": 1.8}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvmgr bench c128``."""
    parser.add_argument("--batch", type=int, default=1, help="requests in the decode steps")
    parser.add_argument("--prefill", nargs="+", type=int, default=[1, 16, 64, 128, 256, 512, 1024])
    parser.add_argument("--steps", type=int, default=200, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print tables; write ``--json``. Returns the exit status.

    0: ran and the boundary output matched the reference; 1: mismatch; 2: no CUDA GPU.
    """
    if not torch.cuda.is_available():
        print("kvmgr bench c128 needs a CUDA GPU (none found); nothing was measured")
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    result: dict[str, Any] = {"info": _info(), "args": vars(args).copy()}
    ok = _check_boundary_step(gen, args.batch)
    result["output_matches_reference"] = ok
    result["decode"] = _decode_rows(gen, args)
    result["ratios"] = _ratios(result["decode"])
    result["prefill"] = [_prefill_row(gen, n, args) for n in args.prefill]
    _print_tables(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
    return 0 if ok else 1


class _Case:
    """One layer and one step: ``starts[r]`` computed tokens, ``qlens[r]`` new ones."""

    def __init__(
        self, gen: torch.Generator, starts: list[int], qlens: list[int], device: str = "cuda"
    ) -> None:
        dev = torch.device(device)
        width = max(s + q for s, q in zip(starts, qlens, strict=True)) // _STATE_BLOCK + 1
        num_reqs, num_tokens = len(starts), sum(qlens)
        table = torch.randperm(num_reqs * width, generator=gen).view(num_reqs, width)
        pos = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, qlens, strict=True)])
        req = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(qlens))
        state_slots = table[req, pos // _STATE_BLOCK] * _STATE_BLOCK + pos % _STATE_BLOCK
        comp_blocks = num_tokens // 64 + 1
        self.layer = {
            "state_cache": torch.randn(num_reqs * width, _STATE_BLOCK, 2 * _D, generator=gen),
            "compressed_cache": torch.randint(
                0, 256, (comp_blocks, 64, c128_entry_bytes(_D)), generator=gen, dtype=torch.uint8
            ),
            "ape": torch.randn(128, _D, generator=gen),
            "norm_weight": 0.5 + torch.rand(_D, generator=gen),
            "cos_sin_cache": rope_cos_sin_cache(int(pos.max()) + 1),
        }
        self.layer = {k: v.to(dev) for k, v in self.layer.items()}
        tensors = {
            "positions": pos,
            "c128.state_slot_mapping": state_slots.to(torch.int32),
            "c128.state_block_table": table.to(torch.int32),
            "c128.req_indices": req.to(torch.int32),
            "c128.slot_mapping": torch.randperm(comp_blocks * 64, generator=gen)[:num_tokens],
            "c128.kv": torch.randn(num_tokens, _D, generator=gen).bfloat16(),
            "c128.score": (3 * torch.randn(num_tokens, _D, generator=gen)).bfloat16(),
        }
        self.tensors = {k: v.to(dev) for k, v in tensors.items()}
        self.starts = np.array(starts, dtype=np.int64)
        self.query_start_loc = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int64)

    def context(self, **kw: Any) -> StepContext:
        return StepContext(num_computed_tokens=self.starts, query_start_loc=self.query_start_loc,
                           tensors=self.tensors, **kw)  # fmt: skip

    def hook(self, *, gated: bool) -> C128CompressorHook:
        lay = self.layer
        return C128CompressorHook(
            state_cache=lay["state_cache"], compressed_cache=lay["compressed_cache"],
            ape=lay["ape"], norm_weight=lay["norm_weight"], cos_sin_cache=lay["cos_sin_cache"],
            gated=gated,
        )  # fmt: skip

    def write_and_compress(self) -> None:
        self.write()
        self.compress()

    def write(self) -> None:
        t = self.tensors
        c128_state_write(t["c128.kv"], t["c128.score"], self.layer["ape"], t["positions"],
                         t["c128.state_slot_mapping"], self.layer["state_cache"])  # fmt: skip

    def compress(self) -> None:
        c128_compress(*self.compress_args(self.layer["compressed_cache"]))

    def compress_args(self, compressed_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t, lay = self.tensors, self.layer
        return (lay["state_cache"], t["c128.state_block_table"], t["c128.req_indices"],
                t["positions"], t["c128.slot_mapping"], lay["norm_weight"],
                lay["cos_sin_cache"], compressed_cache)  # fmt: skip


def _time_steps(step: Callable[[], object], args: argparse.Namespace) -> tuple[float, float]:
    """Median per-step (device us, host us) over runs of ``args.steps`` back-to-back steps."""
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    device_us, host_us = [], []
    for i in range(args.warmup + args.repeats):
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        if i >= args.warmup:
            device_us.append(start.elapsed_time(end) * 1e3 / args.steps)
            host_us.append((t1 - t0) * 1e6 / args.steps)
    return statistics.median(device_us), statistics.median(host_us)


def _capture(launches: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """Warm ``launches`` up on a side stream, then capture them into a graph."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launches()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches()
    return graph


def _decode_rows(gen: torch.Generator, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for position, label in ((126, "non-boundary"), (127, "boundary")):
        case = _Case(gen, [position] * args.batch, [1] * args.batch)
        for gated in (True, False):
            hook, ctx = case.hook(gated=gated), case.context()
            report = hook(ctx)
            device_us, host_us = _time_steps(functools.partial(hook, ctx), args)
            rows.append({"step": label, "mode": "eager", "gated": gated, "launches": report.launches,
                         "device_us": device_us, "host_us": host_us})  # fmt: skip
        for gated in (True, False):
            skips_compress = gated and label == "non-boundary"
            launches = case.write if skips_compress else case.write_and_compress
            graph = _capture(launches)
            device_us, host_us = _time_steps(graph.replay, args)
            rows.append({"step": label, "mode": "graph", "gated": gated,
                         "launches": 1 if skips_compress else 2,
                         "device_us": device_us, "host_us": host_us})  # fmt: skip
    return rows


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ungated / gated step time of the non-boundary step, per mode, against the targets."""
    out = []
    for mode, target in _TARGETS.items():
        time_us = {r["gated"]: r["device_us"] for r in rows
                   if r["mode"] == mode and r["step"] == "non-boundary"}  # fmt: skip
        ratio = time_us[False] / time_us[True]
        out.append({"mode": mode, "gated_us": time_us[True], "ungated_us": time_us[False],
                    "speedup": ratio, "target": target, "met": ratio >= target})  # fmt: skip
    return out


def _prefill_row(gen: torch.Generator, num_tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    import triton.testing

    case = _Case(gen, [0], [num_tokens])
    write_us = triton.testing.do_bench(case.write, warmup=25, rep=100, return_mode="median") * 1e3
    comp_us = triton.testing.do_bench(case.compress, warmup=25, rep=100, return_mode="median") * 1e3
    boundaries = num_tokens // 128
    write_bytes = num_tokens * (2 * _D * 2 + _D * 4 + 2 * _D * 4)
    comp_bytes = boundaries * (128 * 2 * _D * 4 + c128_entry_bytes(_D))
    hook, ctx = case.hook(gated=True), case.context()
    step_us, _ = _time_steps(functools.partial(hook, ctx), args)
    return {"tokens": num_tokens, "boundaries": boundaries, "write_us": write_us,
            "write_gbps": write_bytes / write_us / 1e3, "compress_us": comp_us,
            "compress_gbps": comp_bytes / comp_us / 1e3, "eager_step_us": step_us}  # fmt: skip


def _check_boundary_step(gen: torch.Generator, batch: int) -> bool:
    """Run one boundary step through the hook and compare with the reference."""
    case = _Case(gen, [127] * batch, [1] * batch)
    expected = case.layer["compressed_cache"].clone()
    case.write()
    c128_compress_ref(*case.compress_args(expected))
    case.compress()
    slots = case.tensors["c128.slot_mapping"].long()
    got = case.layer["compressed_cache"].view(-1, c128_entry_bytes(_D))[slots]
    want = expected.view(-1, c128_entry_bytes(_D))[slots]
    nope, rope, exps = c128_unpack(got)
    nope_ref, rope_ref, exps_ref = c128_unpack(want)
    return bool(
        torch.equal(exps, exps_ref)
        and torch.allclose(nope, nope_ref, rtol=0.13, atol=1e-3)
        and torch.allclose(rope, rope_ref, rtol=2**-7, atol=1e-6)
    )


def _info() -> dict[str, object]:
    import triton

    info: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "cuda": torch.version.cuda, "triton": triton.__version__}  # fmt: skip
    try:
        from kvmgr.transfer.info import collect_info

        info.update(collect_info(probe_pinned=False))
    except Exception as exc:  # the probe is informative only; never fail the benchmark on it
        info["info_error"] = repr(exc)
    return info


def _print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(", ".join(f"{k}: {v}" for k, v in result["info"].items()))
    table = Table(title="c128 decode step (per step, median)")
    for col in ("step", "mode", "gated", "launches", "device us", "host us"):
        table.add_column(col, justify="right")
    for r in result["decode"]:
        table.add_row(r["step"], r["mode"], str(r["gated"]), str(r["launches"]),
                      f"{r['device_us']:.2f}", f"{r['host_us']:.2f}")  # fmt: skip
    console.print(table)
    table = Table(title="non-boundary step: ungated / gated")
    for col in ("mode", "gated us", "ungated us", "speedup", "target", "met"):
        table.add_column(col, justify="right")
    for r in result["ratios"]:
        table.add_row(r["mode"], f"{r['gated_us']:.2f}", f"{r['ungated_us']:.2f}",
                      f"{r['speedup']:.2f}x", f">= {r['target']}x", "yes" if r["met"] else "NO")  # fmt: skip
    console.print(table)
    table = Table(title="prefill from position 0 (kernel device time, median)")
    for col in ("tokens", "boundaries", "write us", "write GB/s", "compress us", "compress GB/s",
                "eager hook step us"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in result["prefill"]:
        table.add_row(str(r["tokens"]), str(r["boundaries"]), f"{r['write_us']:.2f}",
                      f"{r['write_gbps']:.1f}", f"{r['compress_us']:.2f}",
                      f"{r['compress_gbps']:.1f}", f"{r['eager_step_us']:.2f}")  # fmt: skip
    console.print(table)
    console.print(f"boundary output matches the reference: {result['output_matches_reference']}")
