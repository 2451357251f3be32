"""The kvmgr command: simulate, bench ..., info, demo.

Offers:
    main            the console script's entry point; returns the exit status
    HelpFormatter   the formatter of every kvmgr parser: shows each flag's default
    cuda_missing    the one "needs a CUDA GPU" check of ``kvmgr bench ...``

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) ->
int``; they are imported only when chosen, so ``kvmgr info`` works without Triton and the
simulator starts without loading GPU code. Expected failures (a ``KVMgrError``, a bad trace file)
print one line and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from kvmgr import __version__
from kvmgr.errors import KVMgrError

__all__ = ["HelpFormatter", "cuda_missing", "main"]

#: ``kvmgr bench NAME`` -> module implementing it.
BENCHES = {
    "swap": "kvmgr.bench.swap",
    "swap-kernel": "kvmgr.bench.swap_kernel",
    "duplex": "kvmgr.bench.duplex",
    "mla-insert": "kvmgr.bench.mla_insert",
    "c128": "kvmgr.bench.c128",
    "dsv4": "kvmgr.bench.dsv4",
    "host": "kvmgr.bench.host",
    "tiers": "kvmgr.bench.tiers",
    "peer": "kvmgr.bench.peer",
    "peer-mla": "kvmgr.bench.peer_mla",
    "vllm": "kvmgr.bench.vllm",
    "pin": "kvmgr.bench.pin",
    "launch-host": "kvmgr.bench.launch_host",
    "ranks": "kvmgr.bench.ranks",
    "policy": "kvmgr.bench.policy",
}
#: ``kvmgr bench NAME`` -> its one line in ``kvmgr bench --help`` (README.md lists the same).
BENCH_HELP = {
    "swap": "batched driver copy vs a per-page loop vs the pinned peak",
    "swap-kernel": "the copy kernel and auto against the batched DMA",
    "duplex": "D2H and H2D at once, per path pair, against two contiguous copies",
    "mla-insert": "per-layer vs grouped MLA cache insert",
    "c128": "the c128 compressor step, gated vs ungated, eager and CUDA graph",
    "dsv4": "a DeepSeek-V4 restore point's sidecar, copied vs recomputed",
    "host": "the manager's own host path (no GPU, no copy)",
    "tiers": "the disk and shared tiers against their ceilings",
    "peer": "kvmgr side by side with C++ baselines after the seed PRs' designs",
    "peer-mla": "the grouped MLA insert against a C++/CUDA baseline",
    "vllm": "scheduler-side host cost against vLLM 0.33's manager, same calls",
    "pin": "where the start-up time of a pinned CPU tier goes",
    "launch-host": "host cost of the kernel hooks' launch paths",
    "ranks": "what tensor-parallel ranks in their own processes cost the scheduler",
    "policy": "host cost of each eviction/admission policy per 512-block step",
}
#: benchmarks that run without a GPU (every other one needs a CUDA GPU; ``pin`` measures only
#: allocation and first touch without one).
CPU_BENCHES = frozenset({"host", "tiers", "vllm", "pin", "dsv4", "launch-host", "ranks", "policy"})
_BENCH_HELP = f"micro-benchmarks (all but {', '.join(sorted(CPU_BENCHES))} need a CUDA GPU)"
#: top-level subcommands (other than ``bench``) -> module.
COMMANDS = {
    "simulate": ("kvmgr.sim.cli", "replay a request trace through a simulated serving loop"),
    "simulate-hybrid": (
        "kvmgr.sim.hybrid_cli",
        "a hybrid model's cache groups against all layers as full attention",
    ),
    "synth-trace": ("kvmgr.sim.synth", "write the seeded synthetic multi-turn chat trace"),
    "info": ("kvmgr._info_cli", "report GPU, driver, CUDA, cuda-python, batch-copy ABI"),
    "demo": ("kvmgr._demo", "store, look up and load a few blocks on the host engine"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default appended, unless its help already names one.

    Flags whose default is ``None`` or ``False`` (unset, off) show no default.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unset = action.default is None or action.default is False
        if unset or action.default == argparse.SUPPRESS or "default" in text.lower():
            return action.help
        return super()._get_help_string(action)


def cuda_missing(command: str) -> str | None:
    """The message to print when ``command`` needs a CUDA GPU and torch sees none, else ``None``.

    Every ``kvmgr bench ...`` passes through here, so they all say it in the same words.
    """
    import torch

    if torch.cuda.is_available():
        return None
    return f"kvmgr {command}: error: needs a CUDA GPU, and torch sees none; nothing was measured"


def _build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmgr", description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kvmgr {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = argv[0] if argv else None
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter
        )
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(run=mod.run)
    bench = sub.add_parser(
        "bench",
        help=_BENCH_HELP,
        description=_BENCH_HELP,
        formatter_class=HelpFormatter,
    )
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    chosen_bench = argv[1] if chosen == "bench" and len(argv) > 1 else None
    for name, module in BENCHES.items():
        help_text = BENCH_HELP[name]
        p = bench_sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter
        )
        if name == chosen_bench:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            run = mod.run if name in CPU_BENCHES else _needs_cuda(f"bench {name}", mod.run)
            p.set_defaults(run=run)
    return parser


def _needs_cuda(
    command: str, run: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    def checked(args: argparse.Namespace) -> int:
        message = cuda_missing(command)
        if message is not None:
            print(message, file=sys.stderr)
            return 2
        return run(args)

    return checked


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvmgr`` console script; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser(args_list)
    args = parser.parse_args(args_list)
    try:
        return int(args.run(args) or 0)
    except KVMgrError as exc:
        print(f"kvmgr {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
