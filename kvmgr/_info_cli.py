"""``kvmgr info``: GPU, driver, CUDA, cuda-python, batch-copy ABI, pinned memory, copy path."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from kvmgr.transfer.info import collect_info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    table = Table(title="kvmgr info")
    table.add_column("what")
    table.add_column("value")
    for key, value in info.items():
        table.add_row(key, str(value))
    Console().print(table)
    return 0
