"""The flags of ``kvmgr simulate`` (one table a flag group) and the checks of their values.

Private to ``kvmgr.sim``: ``cli`` registers them and runs the checks before loading a trace.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

from kvmgr.policy import POLICIES
from kvmgr.sim._counts import count, count_list
from kvmgr.sim.config import SimConfig
from kvmgr.sim.presets import MODEL_PRESETS
from kvmgr.sim.scheduler import WRITE_POLICIES
from kvmgr.sim.sweep import DEFAULT_SWEEP_TOKENS
from kvmgr.sim.trace import BUNDLED_TRACES, bundled_trace_path

__all__ = [
    "DEFAULT_PLOT",
    "add_simulate_flags",
    "check_output_path",
    "config_from_flags",
    "offset_flag",
    "trace_flag",
]

DEFAULT_PLOT = Path("kvmgr-sweep.png")


def offset_flag(text: str) -> str:
    """``"6000"`` or ``"50%"`` (checked here, applied by ``slice_trace``)."""
    body = text.strip().removesuffix("%")
    try:
        value = float(body) if text.strip().endswith("%") else int(body)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or P%, got {text!r}") from None
    if value < 0 or (text.strip().endswith("%") and value >= 100):
        raise argparse.ArgumentTypeError(f"expected N >= 0 or 0 <= P < 100, got {text!r}")
    return text.strip()


def trace_flag(text: str) -> Path:
    """A bundled trace's name (``azure-code``) -> its path; anything else is a file path."""
    return bundled_trace_path(text) if text in BUNDLED_TRACES else Path(text)


def _model_flags(d: SimConfig) -> list[tuple[str, dict[str, Any]]]:
    """``--model`` ... ``--max-memory-gib``: the geometry, the policies, the engine, the hints."""
    return [
        ("--model", dict(choices=list(MODEL_PRESETS), default=d.model,
                         help="KV geometry preset (page bytes); default tiny")),
        ("--block-size", dict(type=int, default=d.block_size,
                              help=f"tokens per block, dividing 512 (default {d.block_size})")),
        ("--policy", dict(choices=sorted(POLICIES), default=d.policy,
                          help="CPU eviction policy; opt = the offline optimum (knows the "
                          "trace's future)")),
        ("--write-policy", dict(choices=WRITE_POLICIES, default=d.write_policy,
                                help="store prefix blocks when filled (through) or when evicted "
                                "(evict)")),
        ("--fail-rate", dict(type=float, default=0.0,
                             help="fail this fraction of store batches on purpose "
                             "(fault-injection soak)")),
        ("--engine", dict(choices=("auto", "host", "cuda", "kernel"), default=d.engine,
                          help="transfer engine (auto: host without a GPU)")),
        ("--seed", dict(type=int, default=d.seed, help="seeds the page fingerprints")),
        ("--hint-precision", dict(type=float, default=None, metavar="P",
                                  help="give stores oracle 'conversation continues' hints of "
                                  "this precision (kvmgr.sim.hints; used by --policy online)")),
        ("--hint-recall", dict(type=float, default=d.hint_recall,
                               help="recall of the oracle hints")),
        ("--hint-horizon-s", dict(type=float, default=d.hint_horizon_s,
                                  help="the oracle hint says 'continues' when a later turn "
                                  "comes within this many seconds")),
        ("--max-memory-gib", dict(type=float, default=d.max_memory_bytes / 2**30,
                                  help="refuse runs whose GPU + CPU pages exceed this")),
    ]  # fmt: skip


def _scheduler_flags(d: SimConfig) -> list[tuple[str, dict[str, Any]]]:
    """``--time-scale`` ... ``--tp``: the simulated scheduler and its cost model."""
    return [
        ("--time-scale", dict(type=float, default=d.time_scale,
                              help="multiply arrival times (< 1 compresses the trace)")),
        ("--max-batched-tokens", dict(type=int, default=d.max_batched_tokens,
                                      help="token budget of one scheduler step (prefill + "
                                      "decode)")),
        ("--max-seqs", dict(type=int, default=d.max_seqs,
                            help="requests running at once, at most")),
        ("--watermark", dict(type=float, default=d.watermark,
                             help="fraction of GPU blocks kept free when admitting")),
        ("--step-ms", dict(type=float, default=d.step_ms, help="fixed cost of a step")),
        ("--tokens-per-s", dict(type=float, default=d.tokens_per_s,
                                help="compute throughput of the virtual GPU")),
        ("--h2d-gbps", dict(type=float, default=d.h2d_gbps,
                            help="CPU->GPU bandwidth charged for loads (GB/s), per rank")),
        ("--tp", dict(type=int, default=d.tp,
                      help="tensor-parallel ranks: each moves 1/N of the loaded bytes in "
                      "parallel")),
    ]  # fmt: skip


_IO_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--trace", dict(type=trace_flag, default=None, metavar="FILE|NAME",
                     help="Mooncake JSONL or Azure 2023 CSV file (.gz ok), or a bundled trace: "
                     f"{', '.join(BUNDLED_TRACES)}; default: the bundled Mooncake conversation "
                     "trace")),
    ("--limit", dict(type=int, default=None, help="replay only the first N requests")),
    ("--offset", dict(type=offset_flag, default=None, metavar="N|P%",
                      help="skip the first N requests (or P percent: 50%% replays the second "
                      "half), from a cold cache; --limit counts from there")),
    ("--json", dict(type=Path, default=None, metavar="FILE",
                    help="also write the report (or the sweep) as JSON")),
    ("--quiet", dict(action="store_true", help="no progress bar")),
]  # fmt: skip

_SWEEP_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--sweep", dict(nargs="?", type=count_list, const=list(DEFAULT_SWEEP_TOKENS), default=None,
                     metavar="TOKENS",
                     help="run these CPU capacities (default 1M,3M,6M,12M,25M,50M,100M)")),
    ("--sweep-policies", dict(default="lru,arc,s3fifo,reuse,opt",
                              help="policies of the sweep (opt: the offline optimum, the "
                              "bound)")),
    ("--plot", dict(type=Path, default=None, metavar="FILE",
                    help=f"with --sweep: image of the sweep (default {DEFAULT_PLOT})")),
    ("--jobs", dict(type=int, default=min(2, os.cpu_count() or 1),
                    help="sweep runs in parallel processes")),
]  # fmt: skip


def _add_all(group: Any, flags: list[tuple[str, dict[str, Any]]]) -> None:
    for flag, options in flags:
        group.add_argument(flag, **options)


def _add_capacity_flags(parser: argparse.ArgumentParser, d: SimConfig) -> None:
    """``--gpu-tokens|--gpu-blocks`` and ``--cpu-tokens|--cpu-blocks`` (one of each pair)."""
    cap = parser.add_argument_group("capacities (K/M/G suffixes are decimal; 'inf' = unbounded)")
    for where, default, what in (
        ("gpu", d.gpu_tokens, "GPU prefix-cache capacity"),
        ("cpu", d.cpu_tokens, "CPU tier capacity"),
    ):
        pair = cap.add_mutually_exclusive_group()
        pair.add_argument(
            f"--{where}-tokens",
            type=count,
            default=default,
            help=f"{what} in tokens (default {default:,})",
        )
        pair.add_argument(f"--{where}-blocks", type=count, default=None, help="... or in blocks")


def add_simulate_flags(parser: argparse.ArgumentParser) -> None:
    """Register the single-instance flags of ``kvmgr simulate`` on ``parser`` (defaults:
    ``SimConfig()``)."""
    d = SimConfig()
    _add_all(parser.add_argument_group("input and output"), _IO_FLAGS)
    _add_capacity_flags(parser, d)
    _add_all(parser.add_argument_group("model and manager"), _model_flags(d))
    _add_all(parser.add_argument_group("scheduler and cost model"), _scheduler_flags(d))
    _add_all(parser.add_argument_group("capacity sweep"), _SWEEP_FLAGS)


def config_from_flags(args: argparse.Namespace) -> SimConfig:
    """The ``SimConfig`` the parsed flags ask for (``--*-blocks`` times ``--block-size``).

    Raises:
        ValueError: a value ``SimConfig`` refuses (its own checks).
    """
    bs = args.block_size
    gpu = args.gpu_tokens if args.gpu_blocks is None else args.gpu_blocks * bs
    cpu = args.cpu_tokens if args.cpu_blocks is None else args.cpu_blocks * bs
    same = (
        "model", "policy", "write_policy", "engine", "seed", "fail_rate", "time_scale",
        "max_batched_tokens", "max_seqs", "watermark", "step_ms", "tokens_per_s", "h2d_gbps",
        "tp", "hint_precision", "hint_recall", "hint_horizon_s",
    )  # fmt: skip
    return SimConfig(
        block_size=bs,
        gpu_tokens=gpu,
        cpu_tokens=cpu,
        max_memory_bytes=_memory_bytes(args.max_memory_gib),
        **{name: getattr(args, name) for name in same},
    )


def _memory_bytes(gib: float) -> int:
    """``--max-memory-gib`` in bytes; ``ValueError`` unless a finite number >= 0."""
    if not (math.isfinite(gib) and gib >= 0):
        raise ValueError(f"--max-memory-gib: expected a finite number >= 0, got {gib}")
    return int(gib * 2**30)


def check_output_path(path: Path | None, flag: str, *, image: bool = False) -> None:
    """Check that ``path`` can be written (its folder exists and is writable; it is no folder).

    Args:
        path: the output file, or ``None`` (nothing to check).
        flag: the flag's name, for the message.
        image: also check that matplotlib can write the suffix (``.png``, ``.svg``, ...).

    Raises:
        ValueError: the path cannot be written, with the reason.
    """
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a folder, expected a file")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: folder {parent} does not exist")
    writable = os.access(path, os.W_OK) if path.exists() else os.access(parent, os.W_OK)
    if not writable:
        raise ValueError(f"{flag} {path}: not writable")
    if image:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            return  # the sweep reports the missing matplotlib itself
        formats = FigureCanvasBase.get_supported_filetypes()
        if path.suffix.lstrip(".").lower() not in formats:
            raise ValueError(
                f"{flag} {path}: expected a suffix matplotlib writes ({', '.join(sorted(formats))})"
            )
