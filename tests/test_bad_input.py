"""Bad input corpus: every public call raises its typed error and leaves the manager unchanged.

Each case runs on a fresh manager holding some state (K0, K1 READY; K2 PENDING; request "r"
resident, request "s" swapped out), snapshots it, makes the bad call, and compares the snapshot:
statistics (less the ``rejected`` counters), index entries, policy order, both allocators, the
block tables, and the bytes of both tiers. Cases marked ``xfail(strict=True)`` are known bugs.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from kvmgr import (
    BlockStateError,
    ClosedError,
    ConfigError,
    GeometryError,
    HookReport,
    InvalidArgumentError,
    InvalidBlockError,
    InvalidKeyError,
    ManagerConfig,
    OffloadManager,
    PoolExhaustedError,
    StepContext,
    UnknownKeyError,
    UnknownRequestError,
)
from kvmgr.testing import check_invariants
from kvmgr.transfer import HostEngine

NUM_GPU = 8
K = [bytes([0x30 + i]) * 16 for i in range(8)]


def _kv() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return [
        torch.randint(1, 256, (NUM_GPU, 584), dtype=torch.uint8, generator=gen),
        torch.randn(NUM_GPU, 2, 288, generator=gen).to(torch.bfloat16),
    ]


def _snapshot(mgr: OffloadManager, kv: list[torch.Tensor]) -> dict[str, Any]:
    """Everything a bad call must leave alone, read through the public snapshot()."""
    stats = attrs.asdict(mgr.statistics())
    stats.pop("rejected")
    snap = mgr.snapshot()
    tables = {}
    for req in ("r", "s", "t", "new"):
        try:
            tables[req] = mgr.block_table(req)
        except UnknownRequestError:
            tables[req] = None
    return {
        "stats": stats,
        "index": {k: (e.cpu_block_id, e.state, e.readers) for k, e in snap.keys.items()},
        "policy": list(getattr(mgr.policy, "ordered_keys", list)()),
        "cpu": (snap.cpu_allocated, snap.cpu_states),
        "gpu": (snap.gpu_allocated, snap.gpu_states, dict(snap.gpu_busy)),
        "tables": tables,
        "snap_tables": dict(snap.tables),
        "swaps": snap.swaps,
        "gpu_bytes": [t.clone() for t in kv],
        "cpu_bytes": mgr.cpu_pool.region.clone(),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    tensors = ("gpu_bytes", "cpu_bytes")
    if {k: v for k, v in a.items() if k not in tensors} != {
        k: v for k, v in b.items() if k not in tensors
    }:
        return False
    return all(torch.equal(x, y) for x, y in zip(a["gpu_bytes"], b["gpu_bytes"])) and torch.equal(
        a["cpu_bytes"], b["cpu_bytes"]
    )


async def _populated(owned: bool) -> tuple[OffloadManager, list[torch.Tensor], asyncio.Future[Any]]:
    kv = _kv()
    cfg = ManagerConfig(num_cpu_blocks=6, engine="host", manage_gpu_blocks=owned)
    mgr = OffloadManager(kv, cfg)
    await mgr.__aenter__()
    if owned:
        mgr.allocate("r", 2)  # GPU 0, 1
        mgr.allocate("s", 2)  # GPU 2, 3
        # an owned pool lets swaps name only held blocks (issue 11): "t" holds the blocks the
        # keyed swaps below and the cases name
        assert mgr.allocate("t", 4) == [4, 5, 6, 7]
    else:
        mgr.append_blocks("r", [0, 1])
        mgr.append_blocks("s", [2, 3])
    preempt = mgr.preempt("s")  # "s" -> CPU 0, 1
    store = mgr.swap_out([5, 6], K[:2])  # K0, K1 -> CPU 2, 3
    await mgr.step()
    await asyncio.gather(preempt, store)
    pending = mgr.swap_out([7], [K[2]])  # K2 queued: PENDING
    return mgr, kv, pending


Call = Callable[[OffloadManager], Any]

# (id, owned GPU pool, call, expected error, xfail reason or None)
CASES: list[
    tuple[str, bool, Call, type[BaseException] | tuple[type[BaseException], ...], str | None]
] = [
    # stream_wait_loads: only None or a stream (was accepted on the host engine)
    ("stream-str", True, lambda m: m.stream_wait_loads("x"), InvalidArgumentError, None),
    ("stream-int", True, lambda m: m.stream_wait_loads(7), InvalidArgumentError, None),
    # swap_out
    ("out-ids-int", True, lambda m: m.swap_out(5, [K[5]]), InvalidBlockError, None),
    ("out-ids-str", True, lambda m: m.swap_out("4", [K[5]]), InvalidBlockError, None),
    ("out-ids-bytes", True, lambda m: m.swap_out(b"\x04", [K[5]]), InvalidBlockError, None),
    ("out-ids-float", True, lambda m: m.swap_out([4.0], [K[5]]), InvalidBlockError, None),
    ("out-ids-bool", True, lambda m: m.swap_out([True], [K[5]]), InvalidBlockError, None),
    ("out-ids-none", True, lambda m: m.swap_out(None, [K[5]]), InvalidBlockError, None),
    ("out-ids-range", True, lambda m: m.swap_out([NUM_GPU], [K[5]]), InvalidBlockError, None),
    ("out-ids-negative", True, lambda m: m.swap_out([-1], [K[5]]), InvalidBlockError, None),
    ("out-ids-dup", True, lambda m: m.swap_out([4, 4], K[5:7]), InvalidBlockError, None),
    # not a sequence (round 4, session 5): a generator would be used up by the check, a set or
    # a dict has no order to pair ids with keys; these were accepted
    ("out-ids-generator", True, lambda m: m.swap_out(iter([4]), [K[5]]), InvalidBlockError, None),
    ("out-ids-dict", True, lambda m: m.swap_out({4: 0}, [K[5]]), InvalidBlockError, None),
    ("out-ids-set", True, lambda m: m.swap_out({4}, [K[5]]), InvalidBlockError, None),
    (
        "out-ids-memoryview",
        True,
        lambda m: m.swap_out(memoryview(b"\x04"), [K[5]]),
        InvalidBlockError,
        None,
    ),
    (
        "many-out-generator",
        True,
        lambda m: m.store_many((b for b in [4]), [K[5]]),
        InvalidBlockError,
        None,
    ),
    ("many-in-set", True, lambda m: m.load_many([K[0]], {4}), InvalidBlockError, None),
    ("in-ids-dict", True, lambda m: m.swap_in([K[0]], {4: 0}), InvalidBlockError, None),
    # a uint64 id >= 2**63 (it wrapped to a negative id)
    (
        "many-out-uint64-huge",
        True,
        lambda m: m.store_many(np.array([2**63], dtype=np.uint64), [K[5]]),
        InvalidBlockError,
        None,
    ),
    ("out-len", True, lambda m: m.swap_out([4, 5], [K[5]]), InvalidKeyError, None),
    ("out-keys-bytes", True, lambda m: m.swap_out([4], K[5]), InvalidKeyError, None),
    ("out-keys-str", True, lambda m: m.swap_out([4], ["k5"]), InvalidKeyError, None),
    (
        "out-keys-bytearray",
        True,
        lambda m: m.swap_out([4], [bytearray(K[5])]),
        InvalidKeyError,
        None,
    ),
    ("out-keys-int", True, lambda m: m.swap_out([4], [5]), InvalidKeyError, None),
    ("out-keys-none", True, lambda m: m.swap_out([4], None), InvalidKeyError, None),
    ("out-keys-dup", True, lambda m: m.swap_out([4, 5], [K[5], K[5]]), InvalidKeyError, None),
    # 1 free + K0, K1 evictable; "s" and the PENDING K2 are not: 4 new keys cannot fit
    ("out-full", True, lambda m: m.swap_out([0, 1, 4, 5], K[3:7]), PoolExhaustedError, None),
    # owned pool (issue 11): a swap may name only held blocks; GPU 2, 3 are free since "s"
    # was preempted
    ("out-not-held", True, lambda m: m.swap_out([4, 2], K[5:7]), InvalidBlockError, None),
    (
        "out-parents-len",
        True,
        lambda m: m.swap_out([4], [K[5]], [None, None]),
        InvalidKeyError,
        None,
    ),
    ("out-parents-str", True, lambda m: m.swap_out([4], [K[5]], ["k"]), InvalidKeyError, None),
    # an empty parent is not a key either (the one key rule, kvmgr._keys); it was accepted
    ("out-parents-empty", True, lambda m: m.swap_out([4], [K[5]], [b""]), InvalidKeyError, None),
    (
        "many-out-parents-empty",
        True,
        lambda m: m.store_many(np.array([4, 5]), K[5:7], parents=[None, b""]),
        InvalidKeyError,
        None,
    ),
    # store_many: the same checks on the batched path
    (
        "many-out-not-held",
        True,
        lambda m: m.store_many(np.array([4, 3]), K[5:7]),
        InvalidBlockError,
        None,
    ),
    ("many-out-2d", True, lambda m: m.store_many(np.array([[4]]), [K[5]]), InvalidBlockError, None),
    (
        "many-out-float",
        True,
        lambda m: m.store_many(np.array([4.0]), [K[5]]),
        InvalidBlockError,
        None,
    ),
    ("many-out-len", True, lambda m: m.store_many(np.arange(4, 8), K[5:7]), InvalidKeyError, None),
    # 9 > num_cpu_blocks keys: more than the tier could ever hold
    (
        "many-out-full",
        True,
        lambda m: m.store_many(
            np.array([4, 5, 6, 7] * 2 + [0]), [bytes([i]) * 8 for i in range(9)]
        ),
        (InvalidBlockError, PoolExhaustedError),
        None,
    ),
    # swap_in
    ("in-not-held", True, lambda m: m.swap_in([K[0]], [3]), InvalidBlockError, None),
    (
        "many-in-not-held",
        True,
        lambda m: m.load_many(K[:2], np.array([4, 2])),
        InvalidBlockError,
        None,
    ),
    ("many-in-unknown", True, lambda m: m.load_many([K[6]], np.array([4])), UnknownKeyError, None),
    ("many-in-pending", True, lambda m: m.load_many([K[2]], np.array([4])), BlockStateError, None),
    ("many-in-dup", True, lambda m: m.load_many(K[:2], np.array([4, 4])), InvalidBlockError, None),
    ("in-unknown", True, lambda m: m.swap_in([K[0], K[6]], [4, 5]), UnknownKeyError, None),
    ("in-pending", True, lambda m: m.swap_in([K[0], K[2]], [4, 5]), BlockStateError, None),
    ("in-ids-range", True, lambda m: m.swap_in([K[0]], [NUM_GPU]), InvalidBlockError, None),
    ("in-ids-dup", True, lambda m: m.swap_in(K[:2], [4, 4]), InvalidBlockError, None),
    ("in-len", True, lambda m: m.swap_in(K[:2], [4]), InvalidKeyError, None),
    ("in-keys-str", True, lambda m: m.swap_in(["k0"], [4]), InvalidKeyError, None),
    # lookup
    ("lookup-bytes", True, lambda m: m.lookup(K[0]), InvalidKeyError, None),
    ("lookup-ints", True, lambda m: m.lookup([1, 2]), InvalidKeyError, None),
    ("lookup-none", True, lambda m: m.lookup(None), InvalidKeyError, None),
    # peek / touch / invalidate
    ("peek-bytes", True, lambda m: m.peek(K[0]), InvalidKeyError, None),
    ("touch-ints", True, lambda m: m.touch([1, 2]), InvalidKeyError, None),
    ("invalidate-str", True, lambda m: m.invalidate(["k0"]), InvalidKeyError, None),
    # K2 is PENDING: refused, and K0 (READY) is not dropped either
    ("invalidate-pending", True, lambda m: m.invalidate([K[0], K[2]]), BlockStateError, None),
    # wait
    ("wait-not-future", True, lambda m: m.wait("x", 1), InvalidArgumentError, None),
    # request level, owned pool
    # a negative count is a bad argument, not a bad block id (core v2 types it so)
    ("alloc-negative", True, lambda m: m.allocate("r", -1), InvalidArgumentError, None),
    ("alloc-full", True, lambda m: m.allocate("new", NUM_GPU), PoolExhaustedError, None),
    ("alloc-swapped-out", True, lambda m: m.allocate("s", 1), BlockStateError, None),
    ("alloc-str", True, lambda m: m.allocate("new", "2"), InvalidArgumentError, None),
    ("alloc-float", True, lambda m: m.allocate("new", 2.0), InvalidArgumentError, None),
    ("alloc-bool", True, lambda m: m.allocate("new", True), InvalidArgumentError, None),
    ("alloc-unhashable", True, lambda m: m.allocate(["new"], 1), InvalidArgumentError, None),
    ("append-owned", True, lambda m: m.append_blocks("r", [4]), ConfigError, None),
    ("preempt-unknown", True, lambda m: m.preempt("nobody"), UnknownRequestError, None),
    ("preempt-swapped-out", True, lambda m: m.preempt("s"), BlockStateError, None),
    ("preempt-unhashable", True, lambda m: m.preempt(["r"]), InvalidArgumentError, None),
    ("resume-resident", True, lambda m: m.resume("r"), BlockStateError, None),
    ("resume-owned-ids", True, lambda m: m.resume("s", [4, 5]), InvalidBlockError, None),
    ("resume-unknown", True, lambda m: m.resume("nobody"), UnknownRequestError, None),
    ("free-unknown", True, lambda m: m.free("nobody"), UnknownRequestError, None),
    ("free-unhashable", True, lambda m: m.free({"r"}), InvalidArgumentError, None),
    ("table-unknown", True, lambda m: m.block_table("nobody"), UnknownRequestError, None),
    ("step-bad-ctx", True, lambda m: m.step(5), InvalidArgumentError, None),  # before any flush
    # request level, caller-owned GPU blocks
    ("alloc-not-owned", False, lambda m: m.allocate("r", 1), ConfigError, None),
    ("append-range", False, lambda m: m.append_blocks("r", [NUM_GPU]), InvalidBlockError, None),
    ("append-dup-in-table", False, lambda m: m.append_blocks("r", [1]), InvalidBlockError, None),
    ("append-dup-in-call", False, lambda m: m.append_blocks("r", [4, 4]), InvalidBlockError, None),
    ("append-swapped-out", False, lambda m: m.append_blocks("s", [4]), BlockStateError, None),
    ("append-int", False, lambda m: m.append_blocks("new", 4), InvalidBlockError, None),
    ("append-bytes", False, lambda m: m.append_blocks("new", b"\x04\x05"), InvalidBlockError, None),
    (
        "append-generator",
        False,
        lambda m: m.append_blocks("new", iter([4])),
        InvalidBlockError,
        None,
    ),
    ("append-dict", False, lambda m: m.append_blocks("new", {4: 0}), InvalidBlockError, None),
    ("resume-set", False, lambda m: m.resume("s", {4, 5}), InvalidBlockError, None),
    ("resume-no-ids", False, lambda m: m.resume("s"), InvalidBlockError, None),
    ("resume-count", False, lambda m: m.resume("s", [4]), InvalidBlockError, None),
    ("resume-dup", False, lambda m: m.resume("s", [4, 4]), InvalidBlockError, None),
    ("resume-range", False, lambda m: m.resume("s", [4, NUM_GPU]), InvalidBlockError, None),
    ("resume-int", False, lambda m: m.resume("s", 4), InvalidBlockError, None),
]


async def _raises_and_changes_nothing(
    mgr: OffloadManager, kv: Any, call: Call, error: type[BaseException]
) -> None:
    """``call(mgr)`` (awaited when it is a coroutine) raises ``error``; the manager's snapshot
    and the KV bytes are as before."""
    before = _snapshot(mgr, kv)
    with pytest.raises(error):
        result = call(mgr)
        if inspect.iscoroutine(result):  # step(); a swap future is never awaited here
            await result
    assert _same(_snapshot(mgr, kv), before)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("owned", "call", "error"),
    [
        pytest.param(
            owned,
            call,
            error,
            id=name,
            marks=[pytest.mark.xfail(strict=True, reason=bug)] if bug else [],
        )
        for name, owned, call, error, bug in CASES
    ],
)
async def test_bad_call_raises_typed_error_and_changes_nothing(
    owned: bool, call: Call, error: type[BaseException]
) -> None:
    mgr, kv, pending = await _populated(owned)
    try:
        await _raises_and_changes_nothing(mgr, kv, call, error)
    finally:
        await mgr.step()
        await pending
        await mgr.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda m: m.swap_out([4], [K[5]]), id="swap_out"),
        pytest.param(lambda m: m.swap_in([K[0]], [4]), id="swap_in"),
        pytest.param(lambda m: m.preempt("r"), id="preempt"),
        pytest.param(lambda m: m.resume("s"), id="resume"),
        pytest.param(lambda m: m.step(), id="step"),
        pytest.param(lambda m: m.allocate("r", 1), id="allocate"),
        pytest.param(lambda m: m.free("r"), id="free"),
        pytest.param(lambda m: m.lookup(K[:2]), id="lookup"),
        pytest.param(lambda m: m.store_many(np.array([4]), [K[5]]), id="store_many"),
        pytest.param(lambda m: m.load_many([K[0]], np.array([4])), id="load_many"),
        pytest.param(lambda m: m.peek(K[:2]), id="peek"),
        pytest.param(lambda m: m.touch(K[:2]), id="touch"),
        pytest.param(lambda m: m.invalidate(K[:2]), id="invalidate"),
        pytest.param(lambda m: m.clear(), id="clear"),
    ],
)
async def test_use_after_close_raises_closed_error(call: Call) -> None:
    mgr, kv, pending = await _populated(True)
    await mgr.step()
    await pending
    await mgr.aclose()
    await _raises_and_changes_nothing(mgr, kv, call, ClosedError)


@pytest.mark.parametrize(
    ("make", "error"),
    [
        pytest.param(
            lambda kv: OffloadManager(kv, {"num_cpu_blocks": 4}), ConfigError, id="dict-config"
        ),
        pytest.param(
            lambda kv: OffloadManager([], ManagerConfig(num_cpu_blocks=4)),
            GeometryError,
            id="no-tensors",
        ),
        pytest.param(
            lambda kv: OffloadManager(kv, ManagerConfig(num_cpu_blocks=4), hooks=[object()]),
            ConfigError,
            id="bad-hook",
        ),
        *(
            pytest.param(
                lambda kv, what=what, value=value: OffloadManager(
                    kv, ManagerConfig(num_cpu_blocks=4), **{what: value}
                ),
                ConfigError,
                id=f"{what}-{type(value).__name__}",  # a new user found TypeError (round 4)
            )
            for what in ("hooks", "tiers")
            for value in (None, 5)
        ),
        pytest.param(
            lambda kv: OffloadManager([torch.empty(4, 0)], ManagerConfig(num_cpu_blocks=4)),
            GeometryError,
            id="zero-byte-pages",
        ),
        pytest.param(
            lambda kv: OffloadManager(
                [torch.empty(4, 8, device="meta")], ManagerConfig(num_cpu_blocks=4, engine="host")
            ),
            GeometryError,
            id="host-engine-non-cpu",
        ),
        pytest.param(
            lambda kv: OffloadManager(kv, ManagerConfig(num_cpu_blocks=4, engine="cuda")),
            GeometryError,
            id="cuda-engine-cpu-tensors",
        ),
    ],
)
def test_bad_constructor_arguments(make: Callable[[list[torch.Tensor]], Any], error: type) -> None:
    with pytest.raises(error):
        make(_kv())


@pytest.mark.asyncio
async def test_hooks_given_as_a_generator_run_every_step() -> None:
    """Found by a new user (round 4): the type check consumed the generator, so the manager
    kept no hooks and ``step()`` flushed stores without running them."""
    calls = []

    class Hook:
        name = "count"

        def __call__(self, ctx: StepContext) -> HookReport:
            calls.append(ctx)
            return HookReport(name=self.name)

    hooks = (hook for hook in [Hook()])
    async with OffloadManager(_kv(), ManagerConfig(num_cpu_blocks=4), hooks=hooks) as mgr:
        report = await mgr.step(StepContext(step=1))
    assert len(calls) == 1 and len(report.hooks) == 1


def test_host_engine_instance_rejects_non_cpu_tensors() -> None:
    engine = HostEngine()
    try:
        with pytest.raises(GeometryError):
            OffloadManager(
                [torch.empty(4, 8, device="meta")], ManagerConfig(num_cpu_blocks=2), engine=engine
            )
    finally:
        engine.close()


def test_step_context_is_frozen() -> None:
    ctx = StepContext(step=1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        ctx.step = 2  # type: ignore[misc]


@pytest.mark.asyncio
async def test_an_empty_key_is_refused_on_every_store_path() -> None:
    """The one key rule (``kvmgr._keys``): ``b""`` is not a key, on the per-call fast path too."""
    kv = [torch.randn(8, 16) for _ in range(2)]
    async with OffloadManager(kv, ManagerConfig(num_cpu_blocks=8, engine="host")) as mgr:
        blocks = mgr.allocate("a", 1)
        with pytest.raises(InvalidKeyError, match="non-empty"):
            await mgr.swap_out(blocks, [b""])
        with pytest.raises(InvalidKeyError, match="non-empty"):
            await mgr.store_many(blocks, [b""])
        check_invariants(mgr)  # nothing was reserved: the block frees at once
        mgr.free("a")
