"""The hint-quality curve of docs/policies.md: gap closed by ``online`` vs hint precision.

Usage: ``PYTHONPATH=. python3 scripts/policy_hint_curve.py [--out docs/policies-hints.png]``

Block replay (``kvmgr.sim.replay``: 512-token blocks, no GPU tier) of the bundled Mooncake trace
and of the synthetic trace (``kvmgr.sim.synth``, seed 0), at 1M, 3M and 6M CPU tokens, with
oracle hints (``kvmgr.sim.hints.oracle_hints``: recall 0.75, horizon 300 s, seed 0) of
precision 0.5 ... 1.0; the share of the LRU -> opt gap closed, and the no-hint value as a
dashed line. Also writes the figures as JSON next to the image.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvmgr.sim.hints import oracle_hints
from kvmgr.sim.replay import replay
from kvmgr.sim.synth import synth_trace
from kvmgr.sim.trace import default_trace_path, load_trace

PRECISIONS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
SIZES = (1_000_000, 3_000_000, 6_000_000)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("docs/policies-hints.png"))
    args = parser.parse_args()
    traces = {"bundled (Mooncake)": load_trace(default_trace_path()), "synthetic": synth_trace()}
    data: dict[str, dict[str, dict[str, float]]] = {}
    for name, trace in traces.items():
        data[name] = {}
        for size in SIZES:
            lru, opt = replay(trace, "lru", size).ratio, replay(trace, "opt", size).ratio
            row = {"none": (replay(trace, "online", size).ratio - lru) / (opt - lru)}
            for p in PRECISIONS:
                hints = oracle_hints(trace, p, 0.75, horizon_s=300.0)
                hit = replay(trace, "online", size, hints=hints).ratio
                row[str(p)] = (hit - lru) / (opt - lru)
            data[name][f"{size // 10**6}M"] = row
            print(name, size, {k: round(v, 3) for k, v in row.items()}, flush=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), dpi=120, sharey=True)
    for ax, (name, rows) in zip(axes, data.items()):
        for n, (size, row) in enumerate(rows.items()):
            ys = [100 * row[str(p)] for p in PRECISIONS]
            ax.plot(PRECISIONS, ys, "o-", color=f"C{n}", label=f"{size} CPU tokens")
            ax.axhline(100 * row["none"], color=f"C{n}", linestyle="--", alpha=0.6)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("hint precision (recall 0.75)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("LRU -> opt gap closed (%)")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "online policy: gain from a 'conversation continues' hint (dashed: no hint)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
