"""The report of ``kvmgr bench mla-insert``: its targets, run metadata and tables (private to
``kvmgr.bench.mla_insert``)."""

from __future__ import annotations

import argparse
import datetime
from typing import Any

import torch

from kvmgr.bench import _tables as tables

__all__ = ["meta", "print_tables", "target_rows"]

_HOST_CAPTION = (
    "host µs: CPU wall time per insert call from an idle GPU (checks + dispatch + enqueue). "
    "per-layer: one check, L ordinary Triton launches; grouped: the public function, a new cache "
    "set each call; same caches: the public function, one cache set, new step tensors; hook: "
    "GroupedMLAInsertHook; launch-only: the hook with validate=False. packed: checks once per "
    "step signature, cuLaunchKernelEx from packed arguments (the default); Triton: "
    "direct_launch=False, Triton's own launch."
)
_TARGET_HOST_US, _TARGET_HOST_MAX_T = 10.0, 512
_TARGET_SPEEDUP, _TARGET_SPEEDUP_MAX_T = 6.0, 512
_TARGET_PEAK_FRACTION, _TARGET_PEAK_T = 0.75, 16384


def target_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, per (kv_cache_dtype, mode): speedup for small T, peak for T=16384."""
    out = []
    for dtype, mode in sorted({(r["kv_cache_dtype"], r["mode"]) for r in rows}):
        mine = [r for r in rows if (r["kv_cache_dtype"], r["mode"]) == (dtype, mode)]
        small = [r["speedup"] for r in mine if r["tokens"] <= _TARGET_SPEEDUP_MAX_T]
        if small:
            target = f"speedup >= {_TARGET_SPEEDUP} for T <= {_TARGET_SPEEDUP_MAX_T}"
            got = min(small)
            out.append(_target(dtype, mode, target, f"min {got:.2f}x", got >= _TARGET_SPEEDUP))
        big = [r["peak_fraction"] for r in mine if r["tokens"] == _TARGET_PEAK_T]
        if big:
            target = f">= {_TARGET_PEAK_FRACTION:.0%} of HBM peak at T = {_TARGET_PEAK_T}"
            met = big[0] >= _TARGET_PEAK_FRACTION
            out.append(_target(dtype, mode, target, f"{big[0]:.1%}", met))
    for dtype in sorted({r["kv_cache_dtype"] for r in rows if r["mode"] == "eager"}):
        mine = [r for r in rows if r["kv_cache_dtype"] == dtype and r["mode"] == "eager"]
        for name in ("grouped", "grouped_same", "hook"):
            host = [r[f"{name}_host_us"] for r in mine if r["tokens"] <= _TARGET_HOST_MAX_T]
            if host:
                target = f"host {name} <= {_TARGET_HOST_US:.0f} µs for T <= {_TARGET_HOST_MAX_T}"
                met = max(host) <= _TARGET_HOST_US
                out.append(_target(dtype, "eager", target, f"max {max(host):.1f} µs", met))
    return out


def _target(dtype: str, mode: str, target: str, got: str, met: bool) -> dict[str, Any]:
    return {"kv_cache_dtype": dtype, "mode": mode, "target": target, "got": got, "met": met}


def meta(args: argparse.Namespace) -> dict[str, Any]:
    """Date, GPU, versions and the arguments of this run."""
    import triton

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "args": {k: v for k, v in vars(args).items() if not callable(v)},
    }


def print_tables(
    args: argparse.Namespace,
    peak_gbps: float,
    rows: list[dict[str, Any]],
    targets: list[dict[str, Any]],
    tuning: list[dict[str, Any]],
) -> None:
    """The rows, the targets and the tile sweep as tables."""
    console = tables.console(190)  # not 80 when piped: keep every column readable
    title = (
        f"MLA insert, L={args.layers} R={args.rank} P={args.rope_dim} block={args.block_size} "
        f"{args.dtype}; HBM copy peak {peak_gbps:,.0f} GB/s"
    )
    console.print(tables.table(title, _COLUMNS, map(_row, rows), caption=_HOST_CAPTION))
    checks = [
        [t["kv_cache_dtype"], t["mode"], t["target"], t["got"], "yes" if t["met"] else "NO"]
        for t in targets
    ]
    columns = ("kv dtype", "mode", "target", "got", "met")
    console.print(tables.table("Targets", columns, checks, justify="left"))
    if tuning:
        top = max(args.tokens)
        tune = [
            [t["kv_cache_dtype"], t["block_tokens"], t["num_warps"], f"{t['us']:.1f}",
             f"{t['peak_fraction']:.1%}"]
            for t in tuning
        ]  # fmt: skip
        columns = ("kv dtype", "block_tokens", "num_warps", "µs", "% peak")
        console.print(tables.table(f"Grouped tile sweep at T={top} (graph)", columns, tune))


_COLUMNS = (
    "kv dtype", "mode", "T", "per-layer µs", "grouped µs", "speedup", "host per-layer µs",
    "host grouped µs", "host grouped Triton µs", "host same caches µs", "host hook µs",
    "host hook Triton µs", "host launch-only µs", "grouped GB/s", "% peak",
)  # fmt: skip
_HOSTS = ("per_layer", "grouped", "grouped_triton", "grouped_same", "hook", "hook_triton",
          "hook_unchecked")  # fmt: skip


def _row(r: dict[str, Any]) -> list[object]:
    hosts = [r[f"{name}_host_us"] for name in _HOSTS]
    return [
        r["kv_cache_dtype"], r["mode"], r["tokens"], f"{r['per_layer_us']:.1f}",
        f"{r['grouped_us']:.1f}", f"{r['speedup']:.2f}x",
        *("-" if us is None else f"{us:.1f}" for us in hosts),
        f"{r['grouped_gbps']:,.0f}", f"{r['peak_fraction']:.1%}",
    ]  # fmt: skip
