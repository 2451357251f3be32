"""The online admission policy, store hints (policy, manager, simulator) and the synthetic trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.errors import BlockStateError, InvalidArgumentError
from kvmgr.policy import OnlinePolicy, StoreHint, make_policy
from kvmgr.policy.hints import hints_per_key
from kvmgr.sim.hints import continue_labels, oracle_hints
from kvmgr.sim.replay import replay
from kvmgr.sim.sweep import gap_closed
from kvmgr.sim.synth import SynthConfig, synth_trace, write_trace
from kvmgr.sim.trace import TraceRequest, load_trace, slice_trace

ANY = lambda key: True  # noqa: E731


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def key(*parts: int) -> bytes:
    """A 16-byte key; the last byte decides shadow sampling (small values are sampled)."""
    return bytes([p % 256 for p in parts]) + bytes(16 - len(parts))


def chain(tag: int, n: int) -> tuple[list[bytes], list[bytes | None]]:
    keys = [key(tag // 256, tag % 256, i) for i in range(n)]
    return keys, [None, *keys[:-1]]


def store(
    policy: OnlinePolicy, keys: list[bytes], parents: list[bytes | None], **kw: object
) -> int:
    """Admit then insert (evicting as needed) like the manager; returns the keys stored."""
    mask = policy.admit(keys, parents, **kw)  # type: ignore[arg-type]
    take = len(keys) if mask.all() else int(np.argmin(mask))
    keys, parents = keys[:take], parents[:take]
    short = len(policy) + len(keys) - policy.capacity
    if short > 0:
        assert policy.evict(short, ANY) is not None
    if keys:
        policy.insert(keys, parents)
    return take


def test_protocol_prefix_consistent_and_atomic() -> None:
    policy = make_policy("online", 8, clock=Clock())
    keys, parents = chain(1, 4)
    assert policy.admit(keys, parents).all()  # not full: everything is admitted
    policy.insert(keys, parents)
    with pytest.raises(BlockStateError):
        policy.insert(keys[:1], [None])
    assert policy.evict(2, ANY) == [keys[3], keys[2]]  # the tip first
    assert policy.evict(3, ANY) is None and len(policy) == 2  # nothing changed
    assert policy.evict(1, lambda k: k != keys[1]) is None  # a pinned leaf pins its parents
    policy.remove([keys[1]])
    assert keys[1] not in policy and len(policy) == 1


def run_loop(policy: object, clock: Clock, steps: int) -> tuple[int, int]:
    """Per step: one chain of 8 fresh blocks never seen again, and one of 32 conversations'
    block, reused every 32 steps (288 blocks stored in between: beyond a 256-block LRU).
    Returns (hits of the conversations in the second half, dead blocks stored there)."""
    hits = dead_stored = 0
    for step in range(steps):
        clock.now = float(step)
        keys, parents = chain(1000 + step, 8)
        took = store(policy, keys, parents)  # type: ignore[arg-type]
        k = key(250, step % 32, 77)
        if k in policy:  # type: ignore[operator]
            policy.touch([k])  # type: ignore[attr-defined]
            hits += step >= steps // 2
        else:
            store(policy, [k], [None])  # type: ignore[arg-type]
        dead_stored += took * (step >= steps // 2)
    return hits, dead_stored


class LRUStore:
    """LRU with the admit() the test's store() calls."""

    def __init__(self, capacity: int) -> None:
        self.inner = make_policy("lru", capacity)
        self.capacity = capacity

    def admit(self, keys: list[bytes], parents: list[bytes | None]) -> np.ndarray:
        return np.ones(len(keys), dtype=bool)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner


def test_learns_to_decline_dead_chains_and_keeps_live_ones() -> None:
    clock = Clock()
    policy = OnlinePolicy(256, clock=clock)
    hits, dead = run_loop(policy, clock, 3000)
    lru_hits, lru_dead = run_loop(LRUStore(256), Clock(), 3000)
    assert lru_hits == 0 and lru_dead == 1500 * 8  # LRU: the conversations never hit
    assert policy.threshold > 0  # the guard found that declining pays here
    assert hits > 1000 and dead < 0.2 * lru_dead
    assert policy.num_declined > 0


def test_never_worse_than_lru_on_a_pure_recency_workload() -> None:
    # every chain is reused in LRU order: declining anything only loses hits
    rng = np.random.default_rng(3)
    requests, t = [], 0.0
    for _ in range(3000):
        t += 0.5
        conv = int(rng.integers(0, 40))
        requests.append(
            TraceRequest(t, 4 * 512, 16, (conv * 10, conv * 10 + 1, conv * 10 + 2, conv * 10 + 3))
        )
    lru = replay(requests, "lru", 100 * 512).ratio
    online = replay(requests, "online", 100 * 512).ratio
    assert online >= lru - 0.005


def test_hints_priority_ttl_and_continue() -> None:
    clock = Clock()
    policy = OnlinePolicy(4, clock=clock)
    a, pa = chain(1, 4)
    store(policy, a, pa, hints=[StoreHint(ttl_s=10.0)] * 4)
    b, pb = chain(2, 2)
    assert not policy.admit(b, pb, hints=[StoreHint(priority=-1)] * 2).any()  # full: declined
    assert policy.admit(b, pb, hints=[StoreHint(priority=1)] * 2).all()
    clock.now = 11.0  # a's TTL ran out: it goes first even if it is the most recent
    c, pc = chain(3, 1)
    store(policy, c, pc)  # its room: a's tip, not the least recent key
    assert a[3] not in policy and c[0] in policy
    policy.touch(a[:1])  # a is now the most recent, c the least
    assert policy.evict(1, ANY) == [a[2]]
    with pytest.raises(ValueError):
        policy.admit(b, pb, hints=[None])


def test_store_hint_validation() -> None:
    with pytest.raises(InvalidArgumentError):
        StoreHint(continue_p=1.5)
    with pytest.raises(InvalidArgumentError):
        StoreHint(ttl_s=0.0)
    with pytest.raises(InvalidArgumentError):
        StoreHint(priority=True)
    h = StoreHint(session="s1", continue_p=0.9)
    assert hints_per_key(h, 3) == [h, h, h] and hints_per_key(None, 3) is None
    with pytest.raises(InvalidArgumentError):
        hints_per_key([h], 2)
    with pytest.raises(InvalidArgumentError):
        hints_per_key(["x", None], 2)


def test_store_hint_refuses_an_unhashable_session() -> None:
    # the online policy keys its sessions by it: a list used to reach the policy's admit and
    # fail there with an untyped TypeError, in the middle of a store_many
    for session in (["conv", 1], {"user": 7}, {1, 2}):
        with pytest.raises(InvalidArgumentError, match="session"):
            StoreHint(session=session)
    assert StoreHint(session=("conv", 1)).session == ("conv", 1)


class SpyOnline(OnlinePolicy):
    seen: ClassVar[list[object]] = []

    def admit(self, keys, parents, hints=None):  # type: ignore[no-untyped-def]
        SpyOnline.seen.append(hints)
        return super().admit(keys, parents, hints=hints)


@pytest.mark.asyncio
async def test_hints_reach_the_policy_through_swap_out_and_store_many(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvmgr import policy as policy_module

    monkeypatch.setitem(policy_module.POLICIES, "online", SpyOnline)
    SpyOnline.seen = []
    gen = torch.Generator().manual_seed(5)
    kv = [torch.randint(1, 255, (8, 64), dtype=torch.uint8, generator=gen) for _ in range(2)]
    config = ManagerConfig(
        num_cpu_blocks=2, engine="host", policy="online", manage_gpu_blocks=False
    )
    async with OffloadManager(kv, config) as mgr:
        hint = StoreHint(session="conv-1", continue_p=0.9)
        first = mgr.swap_out([0, 1], [key(1), key(2)], hint=hint)
        await mgr.step()
        await first
        assert SpyOnline.seen[-1] == [hint, hint]
        # the tier is full: a priority < 0 store is declined, the data stays as it was
        many = mgr.store_many(
            np.array([2, 3]), [key(3), key(4)], hints=[StoreHint(priority=-1), None]
        )
        await mgr.step()
        result = await many
        assert SpyOnline.seen[-1] == [StoreHint(priority=-1), None]
        assert not result.stored.any() and mgr.lookup([key(1), key(2)]) == 2
        with pytest.raises(InvalidArgumentError):
            mgr.store_many(np.array([4]), [key(5)], hints=[hint, hint])
        assert mgr.lookup([key(5)]) == 0


def test_synthetic_trace_is_deterministic_and_loads(tmp_path: Path) -> None:
    config = SynthConfig(seed=7, duration_s=300.0)
    one, two = synth_trace(config), synth_trace(config)
    assert one == two and len(one) > 100
    assert synth_trace(SynthConfig(seed=8, duration_s=300.0)) != one
    a = write_trace(one, tmp_path / "a.jsonl.gz").read_bytes()
    b = write_trace(two, tmp_path / "b.jsonl.gz").read_bytes()
    assert a == b
    loaded = load_trace(tmp_path / "a.jsonl.gz")
    assert [r.hash_ids for r in loaded] == [r.hash_ids for r in one]
    # multi-turn: some request repeats all full blocks of an earlier one
    assert continue_labels(one).mean() > 0.1


def test_oracle_hints_have_the_asked_precision_and_recall() -> None:
    trace = synth_trace(SynthConfig(seed=1, duration_s=900.0))
    labels = continue_labels(trace, 300.0)
    hints = oracle_hints(trace, 0.8, 0.75, horizon_s=300.0, seed=2)
    said = np.array([h.continue_p == 1.0 for h in hints])
    precision = (said & labels).sum() / said.sum()
    recall = (said & labels).sum() / labels.sum()
    assert abs(precision - 0.8) < 0.01 and abs(recall - 0.75) < 0.01
    assert oracle_hints(trace, 0.8, 0.75, horizon_s=300.0, seed=2) == hints
    with pytest.raises(ValueError):
        oracle_hints(trace, 0.0)


def test_slice_trace_offsets() -> None:
    trace = [TraceRequest(10.0 * i, 512, 8, (i,)) for i in range(10)]
    half = slice_trace(trace, "50%")
    assert [r.hash_ids for r in half] == [(i,) for i in range(5, 10)] and half[0].arrival_s == 0.0
    assert [r.hash_ids for r in slice_trace(trace, 2, 3)] == [(2,), (3,), (4,)]
    assert slice_trace(trace) == trace
    with pytest.raises(ValueError):
        slice_trace(trace, 10)
    with pytest.raises(ValueError):
        slice_trace(trace, "100%")


def test_simulate_offset_and_hints_on_the_cli(tmp_path: Path) -> None:
    from kvmgr import cli

    trace = tmp_path / "t.jsonl"
    write_trace(synth_trace(SynthConfig(seed=3, duration_s=200.0)), trace)
    out = tmp_path / "r.json"
    args = ["simulate", "--trace", str(trace), "--offset", "50%", "--limit", "40", "--quiet"]
    args += ["--policy", "online", "--hint-precision", "0.9", "--cpu-tokens", "20K"]
    assert cli.main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["num_requests"] == 40
    assert report["settings"]["hint_precision"] == 0.9
    with pytest.raises(SystemExit):
        cli.main(["simulate", "--trace", str(trace), "--offset", "x", "--quiet"])


def test_gap_closed() -> None:
    class R:
        def __init__(self, policy: str, hit: float) -> None:
            self.settings = {"policy": policy, "cpu_blocks": 10}
            self.hit_ratio = hit

    reports = [R("lru", 0.1), R("online", 0.15), R("opt", 0.3), R("arc", 0.05)]
    assert gap_closed(reports) == pytest.approx([0.0, 0.25, 1.0, -0.25])  # type: ignore[arg-type]
    assert gap_closed(reports[1:2]) == [None]  # type: ignore[arg-type]


def test_reuse_turn_a_branch_off_a_shared_prefix_is_a_new_conversation() -> None:
    from kvmgr.policy import ReusePolicy

    clock = Clock()
    policy = ReusePolicy(64, clock=clock)
    system, _ = chain(1, 2)  # a shared system prompt, stored by the first request
    policy.insert(system, [None, system[0]])
    turns = []
    for conv in range(5):  # five conversations branch off it, a minute apart
        clock.now = 60.0 * (conv + 1)
        keys = [key(2, conv, i) for i in range(3)]
        policy.insert(keys, [system[-1], *keys[:-1]])
        turns.append(policy._seg_of[keys[0]].turn)
    # the first branch cannot be told from a next turn yet; once the prompt was extended,
    # every branch is a new conversation (v1 counted 2, 3, 4, 5, 6: the shared segment's uses)
    assert turns == [2, 1, 1, 1, 1]
    clock.now = 1000.0  # the second conversation's next turn extends its own tip: turn 2
    nxt = [key(3, 0, 0)]
    policy.insert(nxt, [key(2, 1, 2)])
    assert policy._seg_of[nxt[0]].turn == 2
