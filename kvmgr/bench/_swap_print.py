"""The tables of ``kvmgr bench swap`` and ``kvmgr bench swap-kernel`` (private to them)."""

from __future__ import annotations

from typing import Any

from kvmgr.bench import _tables as tables

__all__ = ["print_swap", "print_swap_kernel"]


def print_swap(result: dict[str, Any]) -> None:
    """The result of ``kvmgr bench swap`` as tables."""
    table = tables.table

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    peak = [
        [r["memory"], r["direction"], fmt(r["us"] / 1e3, ".2f"), fmt(r["gbps"], ".1f")]
        for r in result["peak"]
    ]
    copies = [
        [r["geometry"], r["direction"], str(r["blocks"]), str(r["descriptors"]),
         fmt(r["bytes"] / 2**20, ".1f"), r["variant"], fmt(r["us"], ".0f"),
         fmt(r["host_us"], ".0f"), fmt(r["gbps"], ".1f"), fmt(r["x_loop"], ".2f"),
         fmt(r["pct_peak"], ".0f"), "ok" if r["ok"] else "[red]WRONG[/red]"]
        for r in result["copies"]
    ]  # fmt: skip
    keys = ("host_us", "manager_us", "plan_us", "engine_us", "issue_us", "wall_us", "landed_us",
            "target_us")  # fmt: skip
    step = [
        [r["engine"], r["ids"], str(r["swaps"]), str(r["pages"]), str(r["descriptors"]),
         r["path"], *(fmt(r[k], ".0f") for k in keys)]
        if "error" not in r else [r["engine"], r["ids"], f"[red]{r['error']}[/red]"] + [""] * 11
        for r in result["step"]
    ]  # fmt: skip
    console = tables.console()
    console.print(table("pinned copy peak (1 GiB, one cuMemcpyAsync)", "memory,direction,ms,GB/s",
                        peak))  # fmt: skip
    console.print(table("page copies (scattered block ids; x loop = loop us / variant us)",
                        "geometry,dir,blocks,descs,MiB,variant,us,host us,GB/s,x loop,% peak,ok",
                        copies))  # fmt: skip
    console.print(table(
        "OffloadManager.step() host us, 48 x 4 KiB one-block stores (medians; manager = host - "
        "engine; plan = build_plan alone; issue = driver calls or kernel staging + launch)",
        "engine,ids,swaps,pages,descs,path,host,manager,plan,engine,issue,wall,landed,target", step))  # fmt: skip


def print_swap_kernel(result: dict[str, Any]) -> None:
    """The result of ``kvmgr bench swap-kernel`` as tables."""
    table = tables.table
    ok = {True: "ok", False: "[red]NO[/red]"}
    copies = [
        [r["geometry"], r["direction"], str(r["blocks"]), str(r["descriptors"]),
         f"{r['bytes'] / 2**20:.1f}", r["variant"], r["path"], f"{r['us']:.0f}",
         f"{r['host_us']:.0f}", f"{r['gbps']:.1f}", ok[r["ok"]]]
        for r in result["copies"]
    ]  # fmt: skip
    inter = [
        [r["variant"], r["direction"], str(r["copies"]), f"{r['copy_gbps_alone']:.1f}",
         f"{r['copy_gbps_during']:.1f}", f"{r['matmul_us_alone'] / 1e3:.2f}",
         f"{r['matmul_us_during'] / 1e3:.2f}", f"{r['slowdown_pct']:.1f}",
         f"{r['slowdown_pct_min']:.1f}..{r['slowdown_pct_max']:.1f}", f"{r['covered_pct']:.0f}",
         ok[r["gate_ok"]]]
        for r in result["interference"]
    ]  # fmt: skip
    targets = [
        [t["check"], f"{t['value']:.2f}", f"{t['goal']:.2f}", ok[t["ok"]]]
        for t in result["targets"]
    ]
    console = tables.console()
    console.print(table("page copies: batched DMA vs copy kernel vs auto (scattered block ids)",
                        "geometry,dir,blocks,descs,MiB,variant,path,us,host us,GB/s,ok", copies))  # fmt: skip
    console.print(table("interference: bf16 matmul loop on the compute stream while copying "
                        "(medians of gated window triples)",
                        "variant,dir,copies,copy GB/s alone,copy GB/s during,matmul ms alone,"
                        "loop+offload ms,slowdown %,range %,covered %,gate ok", inter))  # fmt: skip
    console.print(table("targets", "check,value,goal,ok", targets))
    console.print(f"fitted calibration: {result.get('calibration')}")
    for error in result["errors"]:
        console.print(f"[red]error[/red]: {error}")
