"""The facade rows of ``kvmgr bench vllm`` (batched and per-call APIs) as ratios to vLLM's
``CPUOffloadingManager``, stepped in turn in one process (``kvmgr.bench.vllm._interleaved``).

    python3 scripts/vllm_rows.py [--policies arc lru] [--steps 30]

Prints per policy and scenario the p50 per step of each kvmgr API over vLLM's, and vLLM's p50.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

# this tree's kvmgr, not the editable install's (a script's own folder heads sys.path, not the cwd)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvmgr
from kvmgr.bench import vllm as bench


async def _rows(policies: list[str], steps: int) -> None:
    print("kvmgr from", Path(kvmgr.__file__).parent, flush=True)
    for policy in policies:
        for scenario, apis in bench.SCENARIOS:
            facade = tuple(a for a in apis if a != "backend")
            samples = await bench._interleaved(policy, scenario, facade, steps)
            theirs = statistics.median(samples["vllm"])
            ratios = {a: round(statistics.median(samples[a]) / theirs, 3) for a in facade}
            print(policy, scenario, ratios, "vLLM p50 us", round(theirs * 1e6), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=["arc", "lru"])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    asyncio.run(_rows(args.policies, args.steps))


if __name__ == "__main__":
    main()
