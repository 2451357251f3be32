"""The manager's state machine, run over every engine kvmgr ships (issue 27: "one state-machine
test runs over every engine").

Rules: requests (allocate, write, preempt, resume, free), keyed stores out of request blocks
(``swap_out`` and ``store_many`` over several requests' blocks, with drawn parents), loads of
READY keys into request blocks (``swap_in`` and ``load_many``), a load and a store of one block
back to back, lookups, peeks, touches, invalidations, clears, steps, engine progress,
cancellations of awaiting tasks, injected batch failures, and a drain.

The machine uses only the public API: GPU blocks come from ``allocate`` (the owned pool), and
state is read only through ``snapshot()``, ``statistics()``, ``block_table()`` and
``is_moving()``. ``store_threshold`` is drawn (1 or 2) and modelled.

The engine is the testing kit's ``ScriptedEngine(inner, hold=True)``: it holds submitted
batches until a ``progress`` rule runs them, in order, on the inner engine, so every state change
happens inside a rule and hypothesis can replay and shrink. ``test_manager_state_machine`` runs
the machine once per engine of ``state_engines.SPECS``: the no-copy engine (bookkeeping only: no
page is compared), the scripted engine's fault modes (seeded failed batches, refused submits,
delayed completions, drawn per example), the host engine, the batched-DMA, copy-kernel and
per-batch choice engines on ``cuda_fakes`` (CPU tensors), and the real ones on CUDA tensors
(``gpu``-marked: skipped without a GPU).

The model is logical: ``req_data[req][i]`` is what logical block ``i`` of request ``req`` must
hold, ``key_data[key]`` what the CPU tier must hold under ``key``, each as ``(bytes, deps)``:
``deps`` are the loads (since the last drain) the value came through. At a drain, values that
depend on a failed load become unknown (``None``); a cancelled load counts as failed only if a
failure was injected since the last drain. Swaps apply to the model in call order: a store and a
load of one GPU block queued in one step must behave as if run in that order.

After every rule: ``check_invariants``, block accounting (no leaks), index == policy == model
keys, the KV events drained so far name exactly the READY keys (each ``stored`` event adds keys
not READY before, each ``removed`` event drops READY ones), nothing reported to the loop's
exception handler. After every drain: no readers, nothing PENDING, every swap's result names the
blocks the snapshot showed when it was queued, and every resident request's GPU pages (so every
completed load), swapped-out request's CPU pages and key's CPU pages hold exactly the model's
bytes.

Default profile ``kvmgr-ci``: derandomized (the same examples every run, no example database),
``EXAMPLES`` examples of ``STEPS`` rules per engine, about 40 s for all CPU engines on a 2-core
machine. More: ``HYPOTHESIS_PROFILE=kvmgr-long python -m pytest -s --timeout 0
tests/manager/test_state_machine.py`` (3000 examples of 80 rules per engine; ``--timeout 0`` lifts
pytest-timeout's 300 s, ``-s`` prints the totals; an interrupt with Ctrl-C prints them too).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from state_engines import PARAMS, EngineSpec

from kvmgr import (
    BlockStateError,
    InvalidKeyError,
    ManagerConfig,
    OffloadManager,
    PoolExhaustedError,
    Tier,
    TransferError,
    TransferTimeoutError,
)
from kvmgr.manager import CpuState, GpuState, ManagerSnapshot
from kvmgr.reports import KVEvent, LoadResult, StoreResult, SwapResult
from kvmgr.testing import ScriptedEngine, check_invariants

_COMMON = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
}
#: per engine, on the CI profile (the fake copy-kernel engines run the kernel under the Triton
#: interpreter: fewer examples there)
EXAMPLES, STEPS, INTERPRETED_EXAMPLES = 20, 30, 6
settings.register_profile(
    "kvmgr-ci",
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    derandomize=True,
    database=None,
    **_COMMON,
)
settings.register_profile("kvmgr-long", max_examples=3000, stateful_step_count=80, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "kvmgr-ci")
if PROFILE not in ("kvmgr-ci", "kvmgr-long"):  # another project profile: keep ours
    PROFILE = "kvmgr-ci"

NUM_GPU, NUM_CPU, MAX_REQUESTS = 10, 6, 4
KEYS = [bytes([0x40 + i]) * 8 for i in range(8)]
Value = tuple[bytes | None, frozenset[int]]  # expected bytes (None: unknown), loads it came through
NO_DEPS: frozenset[int] = frozenset()
#: Totals over every example in this process (printed at the end of the module with ``-s``).
TOTALS: Counter[str] = Counter()


async def _progress(engine: ScriptedEngine, num_batches: int | None = None) -> None:
    """Run (or fail) the oldest held batches, then let the manager see their completion."""
    count = engine.num_pending if num_batches is None else num_batches
    for handle in engine.complete_next(count):
        with contextlib.suppress(TransferError):
            await asyncio.wrap_future(handle.future)
    for _ in range(5):  # completion -> bookkeeping -> futures -> awaiting tasks
        await asyncio.sleep(0)


def _kv(device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    kv_pair = torch.randn(NUM_GPU, 2, 3, 5, generator=gen).to(device)
    return [
        torch.randint(1, 256, (NUM_GPU, 584), dtype=torch.uint8, generator=gen).to(device),
        torch.randn(NUM_GPU, 2, 288, generator=gen).to(torch.bfloat16).to(device),
        kv_pair[:, 0],  # non-dense K half: 60 B pages, 120 B apart
    ]


@attrs.define(eq=False)
class _Swap:
    """A keyed swap the model queued, with what its result must say when it succeeds."""

    task: asyncio.Task[Any]
    batched: bool  # store_many / load_many (array results) rather than swap_out / swap_in
    keys: list[bytes]  # the call's keys
    gpu: list[int]  # the call's GPU blocks
    copied: list[bool]  # per key: a block is copied (stores: fresh and admitted; loads: all)
    cpu: list[int]  # CPU blocks of the copied keys, as the snapshot showed them when queued
    present: list[bool] = attrs.field(factory=list)  # stores: the key was in the tier already


def _kvmgr_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvmgr")]


def _ready_prefix(snap: ManagerSnapshot, keys: Sequence[bytes]) -> int:
    hits = 0
    for key in keys:
        entry = snap.keys.get(key)
        if entry is None or entry.state is not CpuState.READY:
            break
        hits += 1
    return hits


class ManagerMachine(RuleBasedStateMachine):
    """The model over one engine: ``SPEC`` (which engine) and ``FAKE`` (its installed fake
    CUDA, or ``None``) are set by ``test_manager_state_machine`` on a subclass."""

    SPEC: EngineSpec = EngineSpec("host")
    FAKE: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.leaked: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _loop, context: self.leaked.append(context))
        self.kv = _kv(self.SPEC.device)
        self.engine: ScriptedEngine = None  # type: ignore[assignment]  # set by open_manager
        self.num_failed = 0  # batches failed on purpose since the last drain (fail_a_held_batch)
        self.injected_before = 0  # the engine's injected failures and refusals at the last drain
        self.mgr: OffloadManager | None = None
        self.req_data: dict[str, list[Value]] = {}
        self.key_data: dict[bytes, Value] = {}
        self.tasks: list[asyncio.Task[Any]] = []
        self.futures: list[asyncio.Future[Any]] = []  # the manager's, since the last drain
        self.loads: list[asyncio.Task[Any]] = []  # load id = position, since the last drain
        #: per load id: (request, logical block, GPU block, the value it must deliver)
        self.load_targets: list[list[tuple[str, int, int, Value]]] = []
        self.loads_checked: set[int] = set()
        self.last_writer: dict[int, int] = {}  # GPU block -> the last load queued into it
        self.swaps: list[_Swap] = []  # keyed swaps since the last drain
        self.threshold = 1
        self.seen: dict[bytes, int] = {}  # store sightings of keys not admitted yet
        self.event_ready: set[bytes] = set()  # READY keys according to the KV events
        self.event_stored: set[bytes] = set()  # keys of stored events since the last drain
        self.next_req = 0

    # ------------------------------------------------------------------ helpers

    @property
    def m(self) -> OffloadManager:
        assert self.mgr is not None
        return self.mgr

    def _snap(self) -> ManagerSnapshot:
        return self.m.snapshot()

    def _run(self, coro: Any) -> Any:
        """Run on the machine's loop; completions processed meanwhile may drop failed keys."""
        try:
            return self.loop.run_until_complete(coro)
        finally:
            if self.mgr is not None:
                keys = self._snap().keys
                self.key_data = {k: v for k, v in self.key_data.items() if k in keys}

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call a sync manager method inside the loop (swaps need a running loop)."""

        async def call() -> Any:
            return fn(*args, **kwargs)

        return self._run(call())

    def _track(self, future: asyncio.Future[Any]) -> asyncio.Task[Any]:
        async def awaiter() -> Any:
            return await future

        task = self.loop.create_task(awaiter())
        self.tasks.append(task)
        self.futures.append(future)
        return task

    def _ids(self, req: str) -> list[int]:
        return [b for _, b in self.m.block_table(req)]

    def _requests(self, tier: Tier) -> list[str]:
        """Requests in ``tier`` with no preempt or resume in flight."""
        if self.mgr is None:
            return []
        tables = self._snap().tables
        return sorted(
            r
            for r in self.req_data
            if not self.m.is_moving(r) and tables[r].tier is tier and not tables[r].moving
        )

    def _ready(self) -> list[bytes]:
        if self.mgr is None:
            return []
        return sorted(k for k, e in self._snap().keys.items() if e.state is CpuState.READY)

    def _idle(self) -> bool:
        stats = self.mgr.statistics() if self.mgr else None
        return stats is not None and stats.queued_swaps == 0 and stats.batches_in_flight == 0

    def _gpu_page(self, b: int) -> bytes:
        return b"".join(
            t[b].contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in self.kv
        )

    def _cpu_page(self, c: int) -> bytes:
        return b"".join(t[c].numpy().tobytes() for t in self.m.cpu_pool.tensors)

    def _write(self, b: int, seed: int) -> Value:
        self.last_writer.pop(b, None)
        gen = torch.Generator().manual_seed(seed)
        for t in self.kv:
            page = t[b].view(torch.uint8)
            page.copy_(torch.randint(1, 256, page.shape, dtype=torch.uint8, generator=gen))
        if self.SPEC.device == "cuda":
            torch.cuda.synchronize()  # the copy engines' streams read after compute's write
        return self._gpu_page(b), NO_DEPS

    def _take_events(self, events: list[KVEvent] | None = None) -> list[KVEvent]:
        """Drain the KV events (or apply ``events``, already drained) to ``event_ready``,
        checking each transition."""
        if events is None:
            events = self.m.take_events()
        TOTALS["events"] += len(events)
        for ev in events:
            keys = set(ev.keys)
            assert ev.tier == "cpu" and len(keys) == len(ev.keys), ev
            if ev.kind == "stored":
                assert not keys & self.event_ready, f"stored again: {ev}"
                self.event_ready |= keys
                self.event_stored |= keys
            else:
                assert ev.kind == "removed", ev
                assert keys <= self.event_ready, f"removed keys that were not READY: {ev}"
                self.event_ready -= keys
        return events

    def _new_request(self, n: int, seed: int) -> None:
        free = self.m.statistics().gpu_blocks_free
        assert free is not None
        req = f"r{self.next_req}"
        if n > free:
            before = self._snap()
            with pytest.raises(PoolExhaustedError):
                self.m.allocate(req, n)
            assert self._snap() == before
            return
        self.next_req += 1
        ids = self.m.allocate(req, n)
        self.req_data[req] = [self._write(b, seed + i) for i, b in enumerate(ids)]

    def _store(
        self,
        blocks: list[tuple[str, int]],
        keys: list[bytes],
        parents: list[bytes | None] | None = None,
        *,
        batched: bool = False,
    ) -> None:
        """Store ``(request, logical block)`` pairs under ``keys``; model the admission."""
        gpu = [self._ids(req)[i] for req, i in blocks]
        before = self._snap()
        present = [k in before.keys for k in keys]
        admitted = [
            not p and self.seen.get(k, 0) + 1 >= self.threshold for k, p in zip(keys, present)
        ]
        try:
            if batched:
                ids = np.array(gpu, dtype=np.int64) if len(gpu) % 2 else gpu  # both forms
                future = self._call(self.m.store_many, ids, keys, parents=parents)
            else:
                future = self._call(self.m.swap_out, gpu, keys, parents)
        except PoolExhaustedError:
            assert self._snap() == before
            return
        except InvalidKeyError as exc:  # drawn parents that close a key cycle: refused
            assert "key cycle" in str(exc) and self._snap() == before
            TOTALS["cycles_refused"] += 1
            return
        after = self._snap()
        for key, p, a in zip(keys, present, admitted):
            if a:
                self.seen.pop(key, None)
                assert after.keys[key].state is CpuState.PENDING
            elif not p:
                self.seen[key] = self.seen.get(key, 0) + 1
                assert key not in after.keys  # not admitted yet (store_threshold)
        for (req, i), key, a in zip(blocks, keys, admitted):
            if a:
                self.key_data[key] = self.req_data[req][i]
        cpu = [after.keys[k].cpu_block_id for k, a in zip(keys, admitted) if a]
        task = self._track(future)
        self.swaps.append(_Swap(task, batched, keys, gpu, admitted, cpu, present))

    def _load(self, blocks: list[tuple[str, int]], keys: list[bytes], *, batched: bool) -> None:
        snap = self._snap()
        if not all(k in snap.keys and snap.keys[k].state is CpuState.READY for k in keys):
            return  # a store just evicted one
        gpu = [self._ids(req)[i] for req, i in blocks]
        if batched:
            future = self._call(self.m.load_many, keys, np.array(gpu, dtype=np.int64))
        else:
            future = self._call(self.m.swap_in, keys, gpu)
        task = self._track(future)
        self.loads.append(task)
        cpu = [snap.keys[k].cpu_block_id for k in keys]
        self.swaps.append(_Swap(task, batched, keys, gpu, [True] * len(keys), cpu))
        load_id = len(self.loads) - 1
        self.load_targets.append([])
        for key, (req, i), b in zip(keys, blocks, gpu):
            data_bytes, deps = self.key_data[key]
            self.req_data[req][i] = (data_bytes, deps | {load_id})
            self.load_targets[load_id].append((req, i, b, self.key_data[key]))
            self.last_writer[b] = load_id

    def _in_step(self) -> bool:
        """Whether every completion happens inside a rule: the engine holds its batches and
        delays none (else a copy may complete, on an engine thread, at any time)."""
        return self.engine.holding and not self.delay_s

    def _injected(self, *fates: str) -> int:
        """Batches the engine's script gave one of ``fates`` so far (default: failed or
        refused: its drawn fault modes and ``fail_a_held_batch``)."""
        fates = fates or ("fail", "refuse")
        return sum(fate in fates for fate in self.engine.injected.values())

    def _ok(self, load_id: int) -> bool:
        task = self.loads[load_id]
        return task.done() and not task.cancelled() and task.exception() is None

    def _check_completed_loads(self) -> None:
        """Each load whose future resolved delivered the bytes stored under its key, into
        every block no later load or compute write has targeted since."""
        if not self.SPEC.copies:
            return  # the no-copy engine moves no byte
        tables = self._snap().tables
        for load_id, targets in enumerate(self.load_targets):
            if load_id in self.loads_checked or not self.loads[load_id].done():
                continue
            self.loads_checked.add(load_id)
            if not self._ok(load_id):
                continue
            for req, i, b, (want, deps) in targets:
                table = tables.get(req)
                if (
                    want is None
                    or self.last_writer.get(b) != load_id
                    or table is None
                    or table.tier is not Tier.GPU
                    or table.block_ids[i] != b
                    or not all(self._ok(d) for d in deps)
                ):
                    continue
                assert self._gpu_page(b) == want, f"load {load_id} into GPU block {b}"
                TOTALS["loads_checked_on_completion"] += 1

    def _indices(self, data: st.DataObject, req: str) -> list[int]:
        n = len(self.req_data[req])
        return data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))

    def _blocks(self, data: st.DataObject, one_request: bool) -> list[tuple[str, int]]:
        """Distinct (request, logical block) pairs of resident requests (one or several)."""
        reqs = self._requests(Tier.GPU)
        if one_request:
            req = data.draw(st.sampled_from(reqs))
            return [(req, i) for i in self._indices(data, req)]
        pairs = [(r, i) for r in reqs for i in range(len(self.req_data[r]))]
        return data.draw(st.lists(st.sampled_from(pairs), min_size=1, max_size=6, unique=True))

    def _parents(self, data: st.DataObject, keys: list[bytes]) -> list[bytes | None] | None:
        """``None`` (one chain, the default) or a drawn parent per key (never itself)."""
        if data.draw(st.booleans()):
            return None
        return [data.draw(st.sampled_from([None, *[p for p in KEYS if p != k]])) for k in keys]

    # ------------------------------------------------------------------ rules

    @initialize(
        policy=st.sampled_from(["lru", "arc"]),
        merge=st.booleans(),
        threshold=st.sampled_from([1, 1, 2]),
        seed=st.integers(0, 99),
        data=st.data(),
    )
    def open_manager(
        self, policy: str, merge: bool, threshold: int, seed: int, data: st.DataObject
    ) -> None:
        cfg = ManagerConfig(
            num_cpu_blocks=NUM_CPU,
            policy=policy,
            engine=self.SPEC.kind if self.SPEC.device == "cuda" else "host",
            merge=merge,
            store_threshold=threshold,
        )
        self.threshold = threshold
        script: dict[str, Any] = {"poison": self.SPEC.copies}  # no copy: nothing to poison
        if self.SPEC.faults:  # the scripted engine's fault modes, seeded
            script |= {
                "fail_rate": data.draw(st.sampled_from([0.1, 0.25]), label="fail_rate"),
                "refuse_batches": data.draw(st.sets(st.integers(0, 8), max_size=2)),
                "delay_s": data.draw(st.sampled_from([0.0, 0.0, 0.0005]), label="delay_s"),
                "seed": seed,
            }
        self.delay_s = script.get("delay_s", 0.0)
        self.engine = self.SPEC.build(self.FAKE, cfg, script)
        self.mgr = OffloadManager(self.kv, cfg, engine=self.engine)
        self._run(self.mgr.__aenter__())
        # start with two resident requests and three READY keys, so every rule has work
        self._new_request(3, seed)
        self._new_request(2, seed + 10)
        for _ in range(threshold):
            self._store([("r0", 0), ("r0", 1), ("r0", 2)], KEYS[:3])
        self._run(self.mgr.step())
        self._run(_progress(self.engine))

    @precondition(lambda self: len(self.req_data) < MAX_REQUESTS)
    @rule(n=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
    def new_request(self, n: int, seed: int) -> None:
        """Allocate and write: a free GPU block is never one a copy still reads or writes."""
        self._new_request(n, seed)

    @precondition(lambda self: self._idle() and self._requests(Tier.GPU))
    @rule(data=st.data(), seed=st.integers(0, 2**31 - 1))
    def write_block(self, data: st.DataObject, seed: int) -> None:
        """Compute writes a block: only when no swap touches it (here: when idle)."""
        req = data.draw(st.sampled_from(self._requests(Tier.GPU)))
        i = data.draw(st.integers(0, len(self.req_data[req]) - 1))
        self.req_data[req][i] = self._write(self._ids(req)[i], seed)

    @precondition(lambda self: self._requests(Tier.GPU))
    @rule(data=st.data(), batched=st.booleans())
    def swap_out(self, data: st.DataObject, batched: bool) -> None:
        """``swap_out`` of one request's blocks, or ``store_many`` over several requests'."""
        blocks = self._blocks(data, one_request=not batched)
        keys = data.draw(
            st.lists(st.sampled_from(KEYS), min_size=len(blocks), max_size=len(blocks), unique=True)
        )
        self._store(blocks, keys, self._parents(data, keys), batched=batched)

    @precondition(lambda self: self._requests(Tier.GPU) and self._ready())
    @rule(data=st.data(), batched=st.booleans())
    def swap_in(self, data: st.DataObject, batched: bool) -> None:
        """``swap_in`` into one request's blocks, or ``load_many`` into several requests'."""
        blocks = self._blocks(data, one_request=not batched)
        keys = data.draw(
            st.lists(st.sampled_from(self._ready()), min_size=len(blocks), max_size=len(blocks))
        )
        self._load(blocks, keys, batched=batched)

    @precondition(lambda self: self._requests(Tier.GPU) and self._ready())
    @rule(data=st.data(), store_first=st.booleans(), batched=st.booleans())
    def load_and_store_one_block(
        self, data: st.DataObject, store_first: bool, batched: bool
    ) -> None:
        """A load into a block and a store of that block, back to back: the hazard case."""
        req = data.draw(st.sampled_from(self._requests(Tier.GPU)))
        i = data.draw(st.integers(0, len(self.req_data[req]) - 1))
        load_key = data.draw(st.sampled_from(self._ready()))
        absent = [k for k in KEYS if k not in self._snap().keys]
        store_key = data.draw(st.sampled_from(absent or KEYS))
        if store_first:
            self._store([(req, i)], [store_key], batched=batched)
        self._load([(req, i)], [load_key], batched=batched)
        if not store_first:
            self._store([(req, i)], [store_key], batched=batched)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=5), peek=st.booleans())
    def lookup(self, keys: list[bytes], peek: bool) -> None:
        """``lookup`` (touches, counted) or ``peek`` (changes nothing): the READY prefix."""
        before, stats = self._snap(), self.m.statistics()
        hits = self.m.peek(keys) if peek else self.m.lookup(keys)
        assert hits == _ready_prefix(before, keys)
        assert self._snap() == before
        after = self.m.statistics()
        if peek:
            assert (after.peeks, after.lookups) == (stats.peeks + 1, stats.lookups)
        else:
            assert (after.lookups, after.lookup_hits) == (
                stats.lookups + 1,
                stats.lookup_hits + hits,
            )

    @rule()
    def events_by_iterator(self) -> None:
        """A step and engine progress while a task waits in ``events()``: it is woken and
        drains the same stream as ``take_events``, in the same order."""

        async def consume() -> list[KVEvent]:
            got: list[KVEvent] = []

            async def reader() -> None:
                async for event in self.m.events():
                    got.append(event)

            task = self.loop.create_task(reader())
            await asyncio.sleep(0)  # the reader waits: every earlier event was drained
            await self.m.step()
            await _progress(self.engine)
            for _ in range(3):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return got

        events = self._run(consume())
        TOTALS["events_by_iterator"] += len(events)
        self._take_events(events)
        if self._in_step():
            assert self.m.take_events() == []  # nothing left behind

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=5))
    def touch(self, keys: list[bytes]) -> None:
        """Only the policy's order may change: no key, block or event does."""
        before = self._snap()
        self.m.touch(keys)
        assert self._snap() == before
        assert self._take_events() == []

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def invalidate(self, keys: list[bytes]) -> None:
        """Drop READY keys; a key with a store or loads in flight refuses the whole call."""
        self._take_events()
        before = self._snap()
        found = list(dict.fromkeys(k for k in keys if k in before.keys))
        busy = [k for k in found if before.keys[k].state is not CpuState.READY]
        busy += [k for k in found if before.keys[k].readers]
        if busy:
            with pytest.raises(BlockStateError):
                self.m.invalidate(keys)
            assert self._snap() == before
            assert self._take_events() == []
            TOTALS["invalidate_refused"] += 1
            return
        assert self.m.invalidate(keys) == len(found)
        TOTALS["keys_invalidated"] += len(found)
        after = self._snap()
        assert not set(found) & set(after.keys)
        assert self._take_events() == ([KVEvent("removed", tuple(found))] if found else [])
        for key in found:
            del self.key_data[key]

    @rule(now=st.integers(0, 3))
    def clear(self, now: int) -> None:
        """Drop every READY key without loads in flight; the others stay. (Drawn a quarter as
        often as other rules, so the tier fills and evicts between clears.)"""
        if now:
            return
        self._take_events()
        before = self._snap()
        idle = [k for k, e in before.keys.items() if e.state is CpuState.READY and not e.readers]
        assert self.m.clear() == len(idle)
        TOTALS["keys_cleared"] += len(idle)
        assert set(self._snap().keys) == set(before.keys) - set(idle)
        assert self._take_events() == ([KVEvent("removed", tuple(idle))] if idle else [])
        for key in idle:
            del self.key_data[key]

    def _move(self, data: st.DataObject, tier: Tier, move: Callable[[str], Any]) -> None:
        """``move`` (preempt or resume) a request drawn from ``tier``: it is moving, or the
        call was refused for room and nothing changed."""
        req = data.draw(st.sampled_from(self._requests(tier)))
        before = self._snap()
        try:
            self._track(self._call(move, req))
        except PoolExhaustedError:
            assert self._snap() == before
            return
        assert self.m.is_moving(req)

    @precondition(lambda self: self._requests(Tier.GPU))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self._move(data, Tier.GPU, self.m.preempt)

    @precondition(lambda self: self._requests(Tier.CPU))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        self._move(data, Tier.CPU, self.m.resume)

    def _freeable(self) -> list[str]:
        # any request without a preempt/resume in flight, even while stores read its blocks
        return self._requests(Tier.CPU) + self._requests(Tier.GPU)

    @precondition(lambda self: self._freeable())
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self._freeable()))
        self.m.free(req)
        del self.req_data[req]

    @rule(then=st.sampled_from(["nothing", "one batch", "everything"]))
    def step(self, then: str) -> None:
        queued, refused = self.m.statistics().queued_swaps, self._injected("refuse")
        report = self._run(self.m.step())
        if self._injected("refuse") == refused:
            assert report.d2h.swaps + report.h2d.swaps == queued
        else:  # a refused submit: its swaps failed, the report counts the submitted ones
            assert report.d2h.swaps + report.h2d.swaps < queued
            TOTALS["steps_with_a_refused_batch"] += 1
        assert (report.d2h.batches > 0) == (report.d2h.swaps > 0)
        assert (report.h2d.batches > 0) == (report.h2d.swaps > 0)
        if then != "nothing":
            self._run(_progress(self.engine, 1 if then == "one batch" else None))

    @precondition(lambda self: self.engine.waiting_batch_ids)
    @rule(num_batches=st.integers(1, 3))
    def progress(self, num_batches: int) -> None:
        self._run(_progress(self.engine, num_batches))

    @precondition(lambda self: self.engine.waiting_batch_ids)
    @rule(data=st.data())
    def fail_a_held_batch(self, data: st.DataObject) -> None:
        self.engine.fail_later(data.draw(st.sampled_from(self.engine.waiting_batch_ids)))
        self.num_failed += 1
        TOTALS["batches_marked_failed"] += 1

    @precondition(lambda self: any(not t.done() for t in self.tasks))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        data.draw(st.sampled_from([t for t in self.tasks if not t.done()])).cancel()
        self._run(asyncio.sleep(0))

    @precondition(lambda self: any(not f.done() for f in self.futures))
    @rule(data=st.data(), timeout_s=st.sampled_from([None, 0.0, 0.0005]))
    def wait_and_give_up(self, data: st.DataObject, timeout_s: float | None) -> None:
        """``mgr.wait`` on a swap: with a deadline it raises ``TransferTimeoutError`` (or the
        swap's outcome); without one, cancelled, it must not cancel the swap. Either way the
        copy goes on: its blocks stay fenced (the invariants check it)."""
        future = data.draw(st.sampled_from([f for f in self.futures if not f.done()]))

        async def body() -> None:
            if timeout_s is None:
                task = asyncio.ensure_future(self.m.wait(future))
                await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                assert not future.cancelled(), "cancelling mgr.wait cancelled the swap"
                TOTALS["wait_cancelled"] += 1
                return
            try:
                await self.m.wait(future, timeout_s)
                TOTALS["wait_ok"] += 1
            except TransferTimeoutError:
                TOTALS["wait_timed_out"] += 1
            except (TransferError, asyncio.CancelledError):
                TOTALS["wait_failed"] += 1

        self._run(body())

    @rule()
    def drain(self) -> None:
        self._run(self._drain())
        self._check_data()

    async def _drain(self) -> None:
        await self.m.step()
        await _progress(self.engine)
        if self.tasks:  # bounded: a swap whose future never resolves must fail, not hang
            _, never_resolved = await asyncio.wait(self.tasks, timeout=10)
            assert not never_resolved, f"{len(never_resolved)} swaps never resolved"
            for task in self.tasks:  # retrieve failures (a failed swap is expected here)
                if not task.cancelled():
                    task.exception()
        assert self._idle()
        stats = self.m.statistics()
        assert stats.stores_queued == stats.stores_completed + stats.stores_failed
        assert stats.loads_queued == stats.loads_completed + stats.loads_failed
        for key, entry in self._snap().keys.items():  # nothing in flight: no reader, no PENDING
            assert (entry.state, entry.readers) == (CpuState.READY, 0), key.hex()
        self._take_events()
        self._check_completed_loads()
        for swap in self.swaps:
            self._check_result(swap)
        failed = {
            load_id
            for load_id, task in enumerate(self.loads)
            if (task.cancelled() and (self.num_failed or self._injected() > self.injected_before))
            or (not task.cancelled() and task.exception() is not None)
        }

        def settle(value: Value) -> Value:
            return (None if value[1] & failed else value[0], NO_DEPS)

        self.req_data = {r: [settle(v) for v in values] for r, values in self.req_data.items()}
        keys = self._snap().keys
        self.key_data = {k: settle(v) for k, v in self.key_data.items() if k in keys}
        self.tasks, self.loads, self.swaps, self.num_failed = [], [], [], 0
        self.futures = []
        self.injected_before = self._injected()
        self.load_targets, self.loads_checked, self.last_writer = [], set(), {}
        self.event_stored = set()

    def _check_result(self, swap: _Swap) -> None:
        """A swap that succeeded reports the blocks it was queued with; a store's keys were
        announced by a ``stored`` event."""
        if swap.task.cancelled() or swap.task.exception() is not None:
            return
        result = swap.task.result()
        TOTALS[f"{'many' if swap.batched else 'one'}_{'store' if swap.present else 'load'}_ok"] += 1
        block_bytes = self.m.gpu_layout.block_bytes
        copied = [b for b, c in zip(swap.gpu, swap.copied) if c]
        n = len(copied)
        if swap.present:  # a store
            stored = [k for k, c in zip(swap.keys, swap.copied) if c]
            assert set(stored) <= self.event_stored, "a completed store had no stored event"
            if swap.batched:
                assert isinstance(result, StoreResult)
                assert result.stored.tolist() == swap.copied
                assert result.present.tolist() == swap.present
                assert result.cpu_block_ids[result.stored].tolist() == swap.cpu
                assert (result.cpu_block_ids[~result.stored] == -1).all()
                assert result.num_bytes == n * block_bytes
                return
            expected = SwapResult(n, n * block_bytes, len(swap.keys) - n, tuple(swap.cpu))
            assert result == expected._replace(gpu_block_ids=tuple(copied))
        elif swap.batched:
            assert isinstance(result, LoadResult)
            assert result.gpu_block_ids.tolist() == swap.gpu
            assert result.cpu_block_ids.tolist() == swap.cpu
            assert result.num_bytes == n * block_bytes
        else:
            assert result == SwapResult(n, n * block_bytes, 0, tuple(swap.cpu), tuple(swap.gpu))

    async def _cancel_tasks(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _check_data(self) -> None:
        if not self.SPEC.copies:
            return
        snap = self._snap()
        for req, expected in self.req_data.items():
            table = snap.tables[req]
            page = self._gpu_page if table.tier is Tier.GPU else self._cpu_page
            assert [b for _, b in self.m.block_table(req)] == list(table.block_ids)
            for i, (b, (want, _)) in enumerate(zip(table.block_ids, expected)):
                if want is not None:
                    assert page(b) == want, f"request {req} block {i} ({table.tier}, {b})"
                    TOTALS["pages_checked"] += 1
        for key, (want, _) in self.key_data.items():
            if want is not None:
                assert self._cpu_page(snap.keys[key].cpu_block_id) == want, key.hex()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def manager_invariants_hold(self) -> None:
        if self.mgr is not None:
            check_invariants(self.mgr)
            TOTALS["operations"] += 1

    @invariant()
    def completed_loads_hold_their_keys_bytes(self) -> None:
        if self.mgr is not None:
            self._check_completed_loads()

    @invariant()
    def no_block_leaks(self) -> None:
        if self.mgr is None:
            return
        snap = self._snap()
        assert set(snap.tables) == set(self.req_data)
        tables = list(snap.tables.values())
        cpu_held = sum(len(t.block_ids) for t in tables if t.tier is Tier.CPU or t.moving)
        assert len(snap.cpu_allocated) == len(snap.keys) + cpu_held
        gpu_held = sum(len(t.block_ids) for t in tables if t.tier is Tier.GPU or t.moving)
        assert snap.gpu_states is not None and snap.gpu_allocated is not None
        draining = snap.gpu_states.count(GpuState.DRAINING)  # freed, a copy still uses them
        assert len(snap.gpu_allocated) == gpu_held + draining
        if self._idle():
            assert draining == 0
        stats = self.m.statistics()
        assert stats.cpu_keys_pending + stats.cpu_keys_ready == len(snap.keys)
        assert stats.cpu_blocks_used == len(snap.cpu_allocated)
        assert stats.gpu_blocks_free == NUM_GPU - len(snap.gpu_allocated)

    @invariant()
    def index_policy_and_model_agree(self) -> None:
        if self.mgr is None:
            return
        snap = self._snap()
        keys = set(snap.keys)
        assert snap.num_policy_keys == len(keys) and snap.policy_keys == keys
        assert set(self.key_data) == keys

    @invariant()
    def events_name_the_ready_keys(self) -> None:
        if self.mgr is None:
            return
        self._take_events()
        assert self.event_ready == set(self._ready())
        assert self.m.statistics().events_dropped == 0

    @invariant()
    def nothing_leaked_into_the_loop(self) -> None:
        assert self.leaked == []

    def teardown(self) -> None:
        try:
            if self.mgr is not None:
                try:
                    self._run(self._drain())
                    self._check_data()
                    stats = self.mgr.statistics()
                    TOTALS["evictions"] += stats.evictions
                    TOTALS["stores_not_admitted"] += stats.stores_not_admitted
                    TOTALS["stores_failed"] += stats.stores_failed
                    TOTALS["loads_failed"] += stats.loads_failed
                finally:
                    self._run(self.mgr.aclose(timeout_s=5))
                    self._run(self._cancel_tasks())
            elif self.engine is not None:
                self.engine.close()
            assert self.leaked == []
            assert _kvmgr_threads() == [], "threads outlived the manager's close"
        finally:
            self.loop.close()
            TOTALS["examples"] += 1
            self._count_engine()

    def _count_engine(self) -> None:
        """What this example's engine did, under its spec's name (the test checks each engine
        was really exercised: batches copied, faults injected, fake launches made)."""
        if self.engine is None:
            return
        name = self.SPEC.name
        TOTALS[f"{name}.batches"] += self.engine.num_submitted
        for fate in self.engine.injected.values():
            TOTALS[f"{name}.{fate}"] += 1
        stats = self.engine.statistics()
        TOTALS[f"{name}.bytes"] += stats.bytes_d2h + stats.bytes_h2d
        for entry in self.FAKE.log if self.FAKE is not None else ():
            op = entry[0] if isinstance(entry, tuple) else next(iter(entry))
            if op in ("kernel", "paged", "dma", "batch", "loop"):
                TOTALS[f"{name}.fake_{op}"] += 1
        if self.FAKE is not None:
            self.FAKE.log.clear()


@pytest.mark.parametrize("spec", PARAMS)
def test_manager_state_machine(spec: EngineSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine over one engine (``state_engines.SPECS``), its fake CUDA installed."""
    machine = type(f"ManagerMachine_{spec.name}", (ManagerMachine,), {})
    machine.SPEC, machine.FAKE = spec, spec.install(monkeypatch)
    profile = settings.get_profile(PROFILE)
    if spec.fake == "kernel" and PROFILE == "kvmgr-ci":
        profile = settings(profile, max_examples=INTERPRETED_EXAMPLES)
    before = TOTALS.copy()
    run_state_machine_as_test(machine, settings=profile)
    done = {
        k.split(".", 1)[1]: v - before[k]
        for k, v in TOTALS.items()
        if k.startswith(spec.name + ".")
    }
    assert done.get("batches", 0) > 0 and done.get("bytes", 0) > 0, done
    if spec.faults:  # the fault modes were exercised
        assert done.get("fail", 0) > 0 and done.get("refuse", 0) > 0, done
    if spec.fake is not None:  # the copies went through the fake driver or kernel
        assert any(k.startswith("fake_") for k in done), done
    print(f"\n{spec.name}: {dict(sorted(done.items()))}")


@pytest.fixture(scope="module", autouse=True)
def _print_totals() -> Iterator[None]:
    yield
    if TOTALS:
        print(f"\nstateful totals: {dict(sorted(TOTALS.items()))}")
