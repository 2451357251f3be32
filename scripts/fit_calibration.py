"""Fit the transfer cost model (``kvmgr.transfer.cost_model.Calibration``) to GPU measurements.

The constants live in one place, ``Calibration``'s defaults; this script reads the JSON that
the GPU benchmarks write and prints the fitted values beside the defaults, and the changed
fields as a JSON object (paste them into the defaults, or load them with
``Calibration.from_json`` / ``AutoEngine(calibration=...)``).

Inputs (any subset, applied in this order, each on top of the previous fit):
    --swap FILE         ``kvmgr bench swap --json``: DMA per-descriptor costs and bandwidths
    --swap-kernel FILE  ``kvmgr bench swap-kernel --json``: the paged copy kernel's launch,
                        per-descriptor and bandwidth constants (its ``"copies"`` rows, the
                        ``KernelCopy`` path of today's engines) and the interference slowdowns
    --duplex FILE       ``kvmgr bench duplex --json``: both directions together (limit, kernel
                        pair, kernel against DMA) and the staged path's device-to-device GB/s

Usage: ``python3 scripts/fit_calibration.py --swap-kernel sk.json --duplex duplex.json
[--out fitted.json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import attrs

from kvmgr.transfer.cost_model import Calibration


def _load(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        data: dict[str, Any] = json.load(handle)
    return data


def fit(swap: str | None, swap_kernel: str | None, duplex: str | None) -> Calibration:
    """The defaults, refitted from each file given (module docstring)."""
    calib = Calibration()
    if swap:
        data = _load(swap)
        calib = Calibration.fit(data.get("copies", []), calib, peak_rows=data.get("peak", ()))
    if swap_kernel:
        data = _load(swap_kernel)
        calib = Calibration.fit(
            data.get("copies", []), calib, interference_rows=data.get("interference", ())
        )
    if duplex:
        rows = [r for r in _load(duplex).get("duplex", []) if "gbps" in r]
        calib = Calibration.fit_duplex(rows, calib)
    return calib


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--swap")
    parser.add_argument("--swap-kernel")
    parser.add_argument("--duplex")
    parser.add_argument("--out", help="write the fitted fields here as JSON")
    args = parser.parse_args(argv)
    try:
        fitted = fit(args.swap, args.swap_kernel, args.duplex)
    except Exception as exc:  # a missing file or bad rows: say which, keep the defaults
        print(f"fit failed: {exc!r}", file=sys.stderr)
        return 1
    default, new = attrs.asdict(Calibration()), attrs.asdict(fitted)
    for name, value in new.items():
        mark = "" if value == default[name] else "   <- fitted"
        print(f"{name:32s} default {default[name]:10.4g}  fitted {value:10.4g}{mark}")
    changed = {k: round(v, 4) for k, v in new.items() if v != default[k]}
    print(json.dumps({"calibration": changed}))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"calibration": new}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
