"""vLLM's side of ``kvmgr bench vllm``: an ``OffloadingManager`` driven as vLLM's connector
drives it, on the calls of each scenario (``kvmgr.bench.vllm`` documents them).

Private to ``kvmgr.bench``. vLLM is imported inside the functions (the module imports without
it).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

from kvmgr.bench._keys import FreshKeys

__all__ = ["VllmSide", "contexts", "vllm_key", "vllm_steps"]


def vllm_key(key: bytes) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(key, 0)


def contexts(prefix: str, chains: list[list[bytes]]) -> list[Any]:
    from vllm.v1.kv_offload.base import ReqContext

    out = []
    for i, chain in enumerate(chains):
        ctx = ReqContext(req_id=f"{prefix}-{i}")
        for j, k in enumerate(chain):
            ctx.set_offload_key_position(k, (j + 1) * 16)
        out.append(ctx)
    return out


class VllmSide:
    """An ``OffloadingManager`` driven the way vLLM's connector drives it: vLLM's own
    ``CPUOffloadingManager``, or with ``backend`` kvmgr's ``KvmgrOffloadingManager`` (the
    scheduler side of ``KvmgrOffloadingSpec``)."""

    def __init__(self, policy: str, num_cpu_blocks: int, backend: bool = False) -> None:
        self.num_cpu_blocks = num_cpu_blocks
        if backend:
            from kvmgr.integrations.vllm.backend import KvmgrOffloadingManager

            self.mgr: Any = KvmgrOffloadingManager(num_cpu_blocks, policy)
        else:
            from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

            self.mgr = CPUOffloadingManager(num_cpu_blocks, cache_policy=policy)
        self.fill(FreshKeys())

    def fill(self, fresh: FreshKeys) -> None:
        chains = [[vllm_key(k) for k in fresh.take(64)] for _ in range(self.num_cpu_blocks // 64)]
        for ctx, chain in zip(contexts("fill", chains), chains):
            self.mgr.on_new_request(ctx)
            out = self.mgr.prepare_store(chain, ctx)
            assert out is not None
            self.mgr.complete_store(out.keys_to_store, ctx)
            self.mgr.on_request_finished(ctx)

    def stores(self, chains: list[list[bytes]], ctxs: list[Any]) -> None:
        mgr, outs = self.mgr, []
        for chain, ctx in zip(chains, ctxs):
            mgr.on_new_request(ctx)
            outs.append(mgr.prepare_store(chain, ctx))
        for out, ctx in zip(outs, ctxs):
            assert out is not None
            mgr.complete_store(out.keys_to_store, ctx)
            mgr.on_request_finished(ctx)

    def loads(self, chains: list[list[bytes]], ctxs: list[Any]) -> None:
        from vllm.v1.kv_offload.base import LookupResult

        mgr, hit = self.mgr, LookupResult.HIT
        for chain, ctx in zip(chains, ctxs):
            mgr.on_new_request(ctx)
            n = 0
            for k in chain:
                if mgr.lookup(k, ctx) is not hit:
                    break
                n += 1
            assert n == len(chain)
            mgr.prepare_load(chain, ctx)
        for chain, ctx in zip(chains, ctxs):
            mgr.complete_load(chain, ctx)
            mgr.on_request_finished(ctx)


def vllm_steps(
    policy: str, scenario: str, num_cpu_blocks: int, backend: bool = False
) -> Iterator[float]:
    """Seconds of each step of vLLM's ``CPUOffloadingManager`` (or with ``backend`` kvmgr's
    ``KvmgrOffloadingManager``) on the same calls, endlessly."""
    side = VllmSide(policy, num_cpu_blocks, backend)
    fresh = FreshKeys()
    fresh.take(num_cpu_blocks)  # the fill's keys
    hot = [
        [vllm_key(i.to_bytes(8, "little")) for i in range(s, s + 64)]
        for s in range(0, num_cpu_blocks, 64)
    ]
    for i in itertools.count():
        if scenario == "store 512 x 1":
            chains = [[vllm_key(k)] for k in fresh.take(512)]
            ctxs = contexts(f"s{i}", chains)
            t0 = time.perf_counter()
            side.stores(chains, ctxs)
        elif scenario == "lookup+load 32 x 64":
            chains = hot[-32:]
            ctxs = contexts(f"l{i}", chains)
            t0 = time.perf_counter()
            side.loads(chains, ctxs)
        else:
            keys = [vllm_key(k) for k in fresh.take(512)]
            stores = [keys[r * 8 : r * 8 + 8] for r in range(64)]
            loads = [chain[:16] for chain in hot[-16:]]
            sctx, lctx = contexts(f"ms{i}", stores), contexts(f"ml{i}", loads)
            t0 = time.perf_counter()
            side.stores(stores, sctx)
            side.loads(loads, lctx)
        yield time.perf_counter() - t0
