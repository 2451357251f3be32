"""The manager's steady-state store step (``kvmgr bench host``'s 512 one-block stores into a
full CPU tier, every step evicting 512) with ``policy="lru"`` vs ``policy="online"``, alternated
in one process; prints the median step round (us) of each and their ratio.

Usage: ``PYTHONPATH=. python3 scripts/policy_host_ab.py [--steps 400] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics

import kvmgr.bench.host as host
from kvmgr.config import ManagerConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for policy in ("lru", "online"):
            host.ManagerConfig = functools.partial(ManagerConfig, policy=policy)  # type: ignore[misc]
            for api in ("batched", "per-call"):
                row = asyncio.run(host._steady(api, args.steps))
                results.setdefault(f"{policy} {api}", []).append(row["round_us_p50"])
    for name, values in results.items():
        if values:
            print(f"{name:16s} round p50 {statistics.median(values):8.1f} us")
    for api in ("batched", "per-call"):
        lru, online = (statistics.median(results[f"{p} {api}"]) for p in ("lru", "online"))
        print(
            f"{api}: online / lru = {online / lru:.2f} (+{online - lru:.0f} us per 512-block step)"
        )


if __name__ == "__main__":
    main()
