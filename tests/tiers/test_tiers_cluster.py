"""SharedTier over a real Valkey/Redis Cluster (issue 26, section 4): 3 primaries and 3 replicas
on loopback ports, started and stopped here with the server binary (kvmgr.testing.servers). A
batch is split by hash slot and pipelined per node, MOVED and ASK are followed, a primary killed
mid-batch costs misses for a bounded time, never wrong KV or a hang."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator

import numpy as np
import pytest
from redis.crc import key_slot
from tiers_server import random_bridge, server_binary

from kvmgr.testing.servers import LocalCluster
from kvmgr.tiers import SharedTier, TierNamespace

PAGES = (4096, 4096)
NS = TierNamespace("cluster/model", PAGES, ("bfloat16", "bfloat16"), 16, tenant_salt=b"c")


def _keys(n: int, tag: bytes = b"") -> list[bytes]:
    return [b"blk-" + tag + i.to_bytes(4, "little") for i in range(n)]


def _equal(cpu, a, b) -> bool:  # type: ignore[no-untyped-def]
    return all(np.array_equal(t.numpy()[a], t.numpy()[b]) for t in cpu)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    server_binary()  # skip without a server binary (fail in CI)
    with LocalCluster(num_primaries=3, replicas=1, node_timeout_ms=1000) as built:
        yield built


def _node_id(node) -> str:  # type: ignore[no-untyped-def]
    with contextlib.closing(node.client()) as client:
        return client.execute_command("CLUSTER", "MYID").decode()


def _stat(node, name: str) -> int:  # type: ignore[no-untyped-def]
    with contextlib.closing(node.client()) as client:
        return int(client.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0))


@pytest.mark.asyncio
async def test_a_batch_is_split_by_slot_and_pipelined_per_node(cluster) -> None:
    tier = SharedTier(cluster.url, single_tenant=True)
    cpu, bridge = random_bridge(tier, NS, 128, seed=1)
    keys = _keys(64)
    primaries = {cluster.primary_of(k).port for k in NS.stored_keys(keys)}
    assert len(primaries) == 3  # the keys spread over every primary
    before = {n.port: _stat(n, "get") for n in cluster.nodes}
    assert (await bridge.demote(keys, range(64))).all()
    assert (await bridge.promote(keys, range(64, 128))).all()
    assert _equal(cpu, list(range(64, 128)), list(range(64)))
    gets = {n.port: _stat(n, "get") - before[n.port] for n in cluster.nodes}
    assert sum(gets.values()) == 64 and all(gets[p] > 0 for p in primaries)
    stats = tier.statistics()
    assert stats.io_mode == "cluster" and stats.num_errors == 0
    await tier.aclose()


def _set_slot(nodes, slot: int, *args: str) -> None:  # type: ignore[no-untyped-def]
    for node in nodes:
        with contextlib.closing(node.client()) as client:
            client.execute_command("CLUSTER", "SETSLOT", slot, *args)


@pytest.mark.asyncio
async def test_moved_and_ask_are_followed(cluster) -> None:
    tier = SharedTier(cluster.url, single_tenant=True)
    cpu, bridge = random_bridge(tier, NS, 8, seed=2)
    assert (await bridge.demote(_keys(1, b"warm"), [0])).all()  # the map is read
    # a fresh key's (empty) slot, moved to another primary behind the tier's back
    key = _keys(1, b"moved")[0]
    slot = key_slot(NS.stored_keys([key])[0])
    source = cluster.primary_of(NS.stored_keys([key])[0])
    primaries = {cluster.primary_of(bytes([b])).port for b in range(256)}
    target = next(n for n in cluster.nodes if n.port in primaries and n is not source)
    _set_slot([target], slot, "IMPORTING", _node_id(source))
    _set_slot([source], slot, "MIGRATING", _node_id(target))
    # migrating: the source answers ASK for a key it lacks; the tier asks the target
    assert (await bridge.demote([key], [1])).all()
    assert tier.statistics().num_redirects == 1
    # the migration ends: the source answers MOVED; the tier follows and learns the slot
    _set_slot([target, source], slot, "NODE", _node_id(target))
    _set_slot([n for n in cluster.nodes if n.port in primaries - {source.port, target.port}],
              slot, "NODE", _node_id(target))  # fmt: skip
    assert (await bridge.promote([key], [2])).all()
    assert _equal(cpu, [2], [1])
    assert tier.statistics().num_redirects == 2
    assert (await bridge.promote([key], [3])).all()  # straight to the new owner now
    assert tier.statistics().num_redirects == 2
    await tier.aclose()


@pytest.mark.asyncio
async def test_a_primary_killed_mid_batch_costs_bounded_misses_never_wrong_kv() -> None:
    server_binary()
    with LocalCluster(num_primaries=3, replicas=1, node_timeout_ms=1000) as cluster:
        tier = SharedTier(cluster.url, deadline_s=1.0, reconnect_backoff_s=0.1, single_tenant=True)
        cpu, bridge = random_bridge(tier, NS, 256, seed=3)
        keys = _keys(96)
        assert (await bridge.demote(keys, range(96))).all()
        victim = cluster.primary_of(NS.stored_keys(keys)[0])
        on_victim = [cluster.primary_of(k) is victim for k in NS.stored_keys(keys)]
        # a batch in flight when the primary dies: it returns within its deadline, whatever it
        # read is the right KV
        load = asyncio.ensure_future(bridge.promote(keys, range(96, 192)))
        await asyncio.sleep(0.002)
        victim.kill()
        t0 = time.perf_counter()
        hit = await asyncio.wait_for(load, 5.0)
        assert time.perf_counter() - t0 < 2.0
        assert _equal(cpu, [96 + i for i in np.flatnonzero(hit)], list(np.flatnonzero(hit)))
        # until the replica took over: misses (only of the dead primary's keys), fast, no hang
        deadline, first_full, num_missed = time.monotonic() + 20, None, 0
        while time.monotonic() < deadline:
            t1 = time.perf_counter()
            assert (await bridge.demote(keys, range(96))).sum() >= 96 - sum(on_victim)
            hit = await bridge.promote(keys, range(96, 192))
            assert time.perf_counter() - t1 < 2.5  # each call bounded by its deadline
            assert _equal(cpu, [96 + i for i in np.flatnonzero(hit)], list(np.flatnonzero(hit)))
            missed = np.flatnonzero(~hit)
            assert all(on_victim[i] for i in missed)  # only the dead primary's keys miss
            if hit.all():
                first_full = time.monotonic()
                break
            num_missed += 1
            await asyncio.sleep(0.1)
        assert first_full is not None, "the tier never recovered after the failover"
        assert num_missed > 0  # the outage was seen, and it ended:
        assert first_full - (deadline - 20) < 15  # the misses lasted a bounded time
        print(f"failover: misses for {first_full - (deadline - 20):.2f} s, {num_missed} rounds")
        cluster.wait_healthy()
        assert tier.statistics().num_redirects + tier.statistics().num_errors > 0
        await tier.aclose()


def test_simulate_shares_a_tier_on_a_cluster(cluster, tmp_path, capsys) -> None:
    """``kvmgr simulate --instances 2 --shared redis+cluster://...``: the instances share blocks
    through the cluster; every fetched page passes the simulator's fingerprint check."""
    from kvmgr.cli import main

    out = tmp_path / "sim.json"
    argv = ["simulate", "--trace", "mooncake-conversation", "--limit", "300", "--quiet",
            "--instances", "2", "--route", "round-robin", "--shared", cluster.url,
            "--gpu-tokens", "250000", "--cpu-tokens", "1000000", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    shared = json.loads(out.read_text())["runs"]["shared"]
    assert shared["fetched_blocks"] > 0 and shared["tier_bytes_written"] > 0
    assert shared["page_mismatches"] == 0
    capsys.readouterr()
