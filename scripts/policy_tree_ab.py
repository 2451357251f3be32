"""The learned and offline policies (``reuse``, ``online``, ``s3fifo``, ``opt``) of two trees on
one seeded workload: the same answers, and the time of their protocol calls, alternated.

A refactor of a policy must keep its answers and its cost. Each round runs, per policy, one
child process per tree (the trees both define ``kvmgr``), in alternating order; a child drives
a seeded stream of conversations (prefix reuse, chunked prefills, StoreHints for ``online``)
through ``admit``/``insert``/``touch``/``evict``/``remove`` against a tier of 200 blocks and
prints the seconds its calls took and a digest of every answer. Prints per policy and tree the
min / median seconds, the ratio of medians (tree / base), and whether the digests agree.

Usage::

    mkdir -p /tmp/base && git archive main kvmgr | tar -x -C /tmp/base
    python3 scripts/policy_tree_ab.py --base /tmp/base [--tree .] [--rounds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import subprocess
import sys
import time
from typing import Any

POLICIES = ("reuse", "online", "s3fifo", "opt")


def _requests(rng: random.Random, num: int) -> list[list[bytes]]:
    """Conversations: 60% extend a prefix of an earlier request, the rest start anew."""
    out: list[list[bytes]] = []
    for r in range(num):
        if out and rng.random() < 0.6:
            base = rng.choice(out)
            extra = [f"{r}-{j}".encode() for j in range(rng.randint(1, 12))]
            out.append(base[: rng.randint(1, len(base))] + extra)
        else:
            out.append([f"{r}-{j}".encode() for j in range(rng.randint(1, 40))])
    return out


def _child(root: str, name: str, seed: int, capacity: int, num: int) -> dict[str, Any]:
    sys.path.insert(0, root)
    from kvmgr.policy import FutureUses, StoreHint, make_policy

    rng = random.Random(seed)
    reqs = _requests(rng, num)
    now = [0.0]
    options: dict[str, Any] = {"clock": lambda: now[0]} if name in ("reuse", "online") else {}
    future = FutureUses(reqs) if name == "opt" else None
    if future is not None:
        options["future"] = future
    policy = make_policy(name, capacity, **options)
    hints = [None, StoreHint(continue_p=0.9), StoreHint(priority=-1), StoreHint(ttl_s=5.0)]
    digest, spent = hashlib.sha256(), 0.0
    for i, chain in enumerate(reqs):
        now[0] += rng.expovariate(1 / 30.0)
        hit = 0
        while hit < len(chain) and chain[hit] in policy:
            hit += 1
        t0 = time.perf_counter()
        if hit:
            policy.touch(chain[:hit])
        if future is not None:
            future.consume(i)
        new = chain[hit:]
        if not new:
            spent += time.perf_counter() - t0
            continue
        parents = [chain[hit - 1] if hit else None, *new[:-1]]
        if name == "online":
            mask = policy.admit(new, parents, [rng.choice(hints)] * len(new))
        elif hasattr(policy, "admit"):
            mask = policy.admit(new, parents)
        else:
            mask = [True] * len(new)
        take = 0
        while take < len(new) and mask[take]:
            take += 1
        victims: list[bytes] | None = []
        if take and len(policy) + take > capacity:
            victims = policy.evict(len(policy) + take - capacity, lambda key: True)
        if take and victims is not None:
            policy.insert(new[:take], parents[:take])
        spent += time.perf_counter() - t0
        digest.update(repr((list(map(bool, mask)), victims)).encode())
    return {"s": spent, "digest": digest.hexdigest()[:16]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="a tree with the baseline kvmgr/")
    parser.add_argument("--tree", default=".", help="the tree measured (default: here)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--child", nargs=2, metavar=("ROOT", "POLICY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1], 7, 200, args.requests)))
        return
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for name in args.policies:
            order = ("base", "tree") if r % 2 == 0 else ("tree", "base")
            for which in order:
                root = args.base if which == "base" else args.tree
                cmd = [sys.executable, __file__, "--requests", str(args.requests)]
                out = subprocess.run(
                    [*cmd, "--base", args.base, "--child", root, name],
                    check=True, capture_output=True, text=True,
                ).stdout  # fmt: skip
                runs.setdefault((name, which), []).append(json.loads(out))
    print(f"{'policy':8s} {'base min/med ms':>18s} {'tree min/med ms':>18s}  tree/base  answers")
    for name in args.policies:
        base, tree = runs[(name, "base")], runs[(name, "tree")]
        b, t = ([1e3 * x["s"] for x in rows] for rows in (base, tree))
        same = {x["digest"] for x in base} == {x["digest"] for x in tree}
        ratio = statistics.median(t) / statistics.median(b)
        print(
            f"{name:8s} {min(b):8.1f} / {statistics.median(b):7.1f} "
            f"{min(t):8.1f} / {statistics.median(t):7.1f}  {ratio:8.2f}x  "
            f"{'same' if same else 'DIFFER'}"
        )


if __name__ == "__main__":
    main()
