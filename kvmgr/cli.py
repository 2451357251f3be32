"""The ``kvmgr`` command: ``simulate``, ``bench ...``, ``info``, ``demo``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) ->
int``; they are imported only when chosen, so ``kvmgr info`` works without Triton and the
simulator starts without loading GPU code. Expected failures (a ``KVMgrError``, a bad trace file)
print one line and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvmgr import __version__
from kvmgr.errors import KVMgrError

__all__ = ["main"]

#: ``kvmgr bench NAME`` -> module implementing it.
BENCHES = {
    "swap": "kvmgr.bench.swap",
    "swap-kernel": "kvmgr.bench.swap_kernel",
    "mla-insert": "kvmgr.bench.mla_insert",
    "c128": "kvmgr.bench.c128",
    "peer-mla": "kvmgr.bench.peer_mla",
}
#: top-level subcommands (other than ``bench``) -> module.
COMMANDS = {
    "simulate": ("kvmgr.sim.cli", "replay a request trace through a simulated serving loop"),
    "info": ("kvmgr._info_cli", "report GPU, driver, CUDA, cuda-python, batch-copy ABI"),
    "demo": ("kvmgr._demo", "store, look up and load a few blocks on the host engine"),
}


def _build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmgr", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvmgr {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = argv[0] if argv else None
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(run=mod.run)
    bench = sub.add_parser("bench", help="GPU micro-benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    chosen_bench = argv[1] if chosen == "bench" and len(argv) > 1 else None
    for name, module in BENCHES.items():
        p = bench_sub.add_parser(name, help=f"benchmark: {name}")
        if name == chosen_bench:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(run=mod.run)
    return parser


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
