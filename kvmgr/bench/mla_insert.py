"""``kvmgr bench mla-insert``: per-layer vs grouped MLA cache insert on one CUDA GPU.

Offers:
    add_arguments   adds this benchmark's options to an ``argparse`` parser
    run             runs it, prints a table (and writes JSON with ``--json``); returns an exit code

Bytes moved by one insert of T tokens into L layers (padding-free steps)::

    bytes = L * T * (R + P) * (input_itemsize + cache_itemsize)    # rows read + rows written
          + T * 8                                                  # the shared int64 slot_mapping

(the FP8 scales and the pointer table, at most 12 bytes per layer, are left out). Achieved GB/s
is ``bytes / time`` and is compared with the HBM copy peak measured in the same run: a
device-to-device copy of 1 GiB, counting bytes read plus bytes written. Each variant is timed
after a warm-up with CUDA events (median of ``--reps`` samples), over up to 16 rotating input
sets so that mid-size steps do not run from L2; every sample covers at least 16 inserts, back to
back. "eager" includes the host's launch cost, "graph" replays one CUDA graph holding a sample's
inserts.

Host columns (eager only): wall-clock host microseconds per insert call, timed with
``perf_counter`` from an idle GPU (synchronised before each sample, so nothing waits on the GPU):
checks, Triton dispatch and the driver's enqueue. ``per-layer`` is L ordinary Triton launches
after one check of all inputs; ``grouped`` is the public function over the rotating sets (a new
cache set every call: the memo's lookup, the step's signature, one launch); ``grouped same
caches`` the public function with the first set's caches and each set's step tensors (a serving
loop: one model's caches, new step tensors every step); ``hook`` is
:class:`GroupedMLAInsertHook` (caches checked at construction; the step's signature per call);
``hook unchecked`` the hook with ``validate=False``: the launch alone. The ``Triton`` columns are
the same calls with ``direct_launch=False`` (Triton's own launch, the baseline).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvmgr.bench._mla_insert_report import meta, print_tables, target_rows
from kvmgr.bench._mla_insert_sets import TIMED, bound_calls, make_sets, variant_calls
from kvmgr.bench._options import add_output, int_list, positive_int

__all__ = ["add_arguments", "run"]

_MIN_INSERTS_PER_SAMPLE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``mla-insert`` options to ``parser``."""
    default_tokens = ",".join(str(2**i) for i in range(15))
    parser.add_argument(
        "--tokens", type=int_list, default=default_tokens, help="comma-separated token counts T"
    )
    parser.add_argument("--layers", type=int, default=5, help="layers L (default 5)")
    parser.add_argument("--rank", type=int, default=512, help="kv_lora_rank R (default 512)")
    parser.add_argument("--rope-dim", type=int, default=64, help="qk_rope_head_dim P (default 64)")
    parser.add_argument(
        "--block-size", type=positive_int, default=64, help="tokens per cache block"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--kv-cache-dtypes", default="fp8_e4m3,auto", help="comma-separated")
    parser.add_argument("--modes", default="eager,graph", help="comma-separated: eager, graph")
    parser.add_argument("--reps", type=int, default=25, help="timed repetitions (median)")
    parser.add_argument(
        "--rotate-mib", type=int, default=256, help="input footprint to rotate over"
    )
    parser.add_argument(
        "--tune", action="store_true", help="also sweep tile sizes at the largest T (graph)"
    )
    add_output(parser)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 on success, 2 when no CUDA GPU (or Triton) is available."""
    if not torch.cuda.is_available():
        print("kvmgr bench mla-insert: needs a CUDA GPU, and torch sees none.", file=sys.stderr)
        return 2
    try:
        from kvmgr.kernels.mla import api as mla_insert
    except ImportError as exc:  # Triton missing
        print(f"kvmgr bench mla-insert: cannot load the kernels ({exc}).", file=sys.stderr)
        return 2
    tokens = list(args.tokens)
    kv_cache_dtypes = args.kv_cache_dtypes.split(",")
    modes = args.modes.split(",")
    peak_gbps = _copy_peak_gbps(args.reps)
    rows = []
    for kv_cache_dtype in kv_cache_dtypes:
        for num_tokens in tokens:
            sets = make_sets(args, kv_cache_dtype, num_tokens)
            calls = variant_calls(mla_insert, sets)
            for mode in modes:
                rows.append(
                    _mode_row(args, (kv_cache_dtype, num_tokens, mode), sets, calls, peak_gbps)
                )
            del sets, calls
    tuning = _tune(args, mla_insert.grouped_mla_insert, max(tokens), peak_gbps) if args.tune else []
    targets = target_rows(rows)
    print_tables(args, peak_gbps, rows, targets, tuning)
    if args.json:
        result = {"meta": meta(args), "hbm_copy_peak_gbps": peak_gbps, "rows": rows}
        result.update(targets=targets, tuning=tuning)
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2, default=str)
    return 0


def _mode_row(
    args: argparse.Namespace,
    case: tuple[str, int, str],
    sets: list[dict[str, Any]],
    calls: dict[str, list[Any]],
    peak_gbps: float,
) -> dict[str, Any]:
    """One row of ``case`` (KV-cache dtype, tokens, mode): the timed variants' device
    microseconds, every variant's host microseconds (eager only), the grouped insert's GB/s and
    its share of the copy peak."""
    kv_cache_dtype, num_tokens, mode = case
    time_us = {name: _time_us(calls[name], mode, args.reps) for name in TIMED}
    host_us: dict[str, float | None] = dict.fromkeys(calls)  # none for graphs
    if mode == "eager":
        host_us = {name: _host_us(c, args.reps) for name, c in calls.items()}
    gbps = sets[0]["bytes"] / (time_us["grouped"] * 1e-6) / 1e9
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "mode": mode,
        "tokens": num_tokens,
        "per_layer_us": time_us["per_layer"],
        "grouped_us": time_us["grouped"],
        "speedup": time_us["per_layer"] / time_us["grouped"],
        **{f"{name}_host_us": us for name, us in host_us.items()},
        "bytes": sets[0]["bytes"],
        "grouped_gbps": gbps,
        "peak_fraction": gbps / peak_gbps,
    }


def _sample(calls: list[Any]) -> tuple[Callable[[], None], int]:
    """A sample (the sets' inserts, repeated until there are at least 16) and its insert count."""
    repeats = max(1, -(-_MIN_INSERTS_PER_SAMPLE // len(calls)))

    def run_sample() -> None:
        for _ in range(repeats):
            for call in calls:
                call()

    return run_sample, repeats * len(calls)


def _time_us(calls: list[Any], mode: str, reps: int) -> float:
    """Median device-side microseconds per insert (CUDA events around each sample)."""
    run_sample, num_inserts = _sample(calls)
    run_sample()  # compile and build pointer tables, outside any capture
    launch = run_sample
    if mode == "graph":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_sample()
        launch = graph.replay
    elif mode != "eager":
        raise ValueError(f"mode: expected 'eager' or 'graph', got {mode!r}")
    return _median_ms(launch, reps) * 1e3 / num_inserts


def _host_us(calls: list[Any], reps: int) -> float:
    """Median host microseconds per insert call, each sample started from an idle GPU."""
    run_sample, num_inserts = _sample(calls)
    run_sample()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start_s = time.perf_counter()
        run_sample()
        samples.append(time.perf_counter() - start_s)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6 / num_inserts


def _median_ms(launch: Callable[[], object], reps: int) -> float:
    launch()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]  # type: ignore[no-untyped-call]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]  # type: ignore[no-untyped-call]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        launch()
        end.record()
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)))


def _copy_peak_gbps(reps: int) -> float:
    """HBM peak: a 1 GiB device-to-device copy, bytes read + written per second."""
    src = torch.ones(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (_median_ms(lambda: dst.copy_(src), reps) * 1e-3) / 1e9


def _tune(
    args: argparse.Namespace, grouped: Callable[..., None], num_tokens: int, peak_gbps: float
) -> list[dict[str, Any]]:
    """Grouped kernel at ``num_tokens`` (every kv_cache_dtype, graph mode) over tile choices."""
    results = []
    for kv_cache_dtype in args.kv_cache_dtypes.split(","):
        sets = make_sets(args, kv_cache_dtype, num_tokens)
        for block_tokens in (1, 2, 4, 8, 16):
            for num_warps in (2, 4, 8):
                tiles = {"block_tokens": block_tokens, "num_warps": num_warps}
                us = _time_us(bound_calls(grouped, sets, **tiles), "graph", args.reps)
                gbps = sets[0]["bytes"] / (us * 1e-6) / 1e9
                results.append(
                    {
                        "kv_cache_dtype": kv_cache_dtype,
                        **tiles,
                        "us": us,
                        "peak_fraction": gbps / peak_gbps,
                    }
                )
        del sets
    return results
