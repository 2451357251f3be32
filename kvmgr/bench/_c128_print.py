"""The tables of ``kvmgr bench c128`` (private to ``kvmgr.bench.c128``)."""

from __future__ import annotations

from typing import Any

from kvmgr.bench import _tables as tables

__all__ = ["TARGET_BATCH", "print_tables"]

TARGET_BATCH = 1  # the batch the targets apply to


def print_tables(result: dict[str, Any]) -> None:
    """The result of ``kvmgr bench c128`` as tables."""
    console = tables.console()
    console.print(", ".join(f"{k}: {v}" for k, v in result["info"].items()))
    cols = ["batch", "step", "mode", "steps/replay", "gated", "launches", "device us", "host us"]
    keys = ["batch", "step", "mode", "per_replay", "gated", "launches", "device_us", "host_us"]
    rows = [[r[k] for k in keys] for r in result["decode"]]
    console.print(tables.table("c128 decode step (per step, median)", cols, rows))
    cols = ["batch", "mode", "steps/replay", "gated us", "ungated us", "speedup", "target", "met",
            "P(no boundary)"]  # fmt: skip
    rows = []
    for r in result["ratios"]:
        target = "-" if r["target"] is None else f">= {r['target']}x"
        met = {None: "-", True: "yes", False: "NO"}[r["met"]]
        rows.append([r["batch"], r["mode"], r["per_replay"], r["gated_us"], r["ungated_us"],
                     f"{r['speedup']:.2f}x", target, met, f"{r['p_no_boundary']:.0%}"])  # fmt: skip
    console.print(tables.table("non-boundary step: ungated / gated device time", cols, rows))
    console.print(
        f"Targets apply to batch {TARGET_BATCH}: eager, and graph with several steps per replay"
        " (device time per step); one step per replay is bound by the graph launch itself."
        " P(no boundary) = (127/128)**batch for random positions."
    )
    rows = [[r["part"], r["host_us"], r["note"]] for r in result["host_breakdown"]]
    console.print(
        tables.table("host breakdown, batch-1 decode step", ["part", "host us", "note"], rows)
    )
    cols = ["tokens", "boundaries", "write us", "write GB/s", "compress us", "compress GB/s",
            "eager hook step us"]  # fmt: skip
    keys = ["tokens", "boundaries", "write_us", "write_gbps", "compress_us", "compress_gbps",
            "eager_step_us"]  # fmt: skip
    rows = [[r[k] for k in keys] for r in result["prefill"]]
    console.print(
        tables.table("prefill from position 0 (kernel device time in a graph)", cols, rows)
    )
    console.print(f"boundary outputs match the reference: {result['output_matches_reference']}")
