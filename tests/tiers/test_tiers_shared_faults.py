"""Faults of the shared tier that must not become outages (issue 26, section 2), each against the
real server (tests/tiers_server.py): a full connection pool, a frozen or black-holed server,
passwords and TLS settings that went wrong silently, tenants on one server, writes sent twice
and TTLs dropped."""

from __future__ import annotations

import asyncio
import socket
import time
import warnings

import numpy as np
import pytest
import redis
from tiers_server import make_certs, random_bridge, random_cpu_tensors, tls_server

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.errors import (
    ConfigError,
    TierError,
    TierSecurityWarning,
    TierTimeoutError,
    TierUnavailableError,
)
from kvmgr.tiers import SharedTier, TierBridge, TierNamespace
from kvmgr.tiers.blob import encode_rows

PAGES = (4096, 2048)


def _ns(salt: bytes = b"") -> TierNamespace:
    return TierNamespace("faults/model", PAGES, ("bfloat16", "uint8"), 16, tenant_salt=salt)


def _keys(n: int, tag: bytes = b"") -> list[bytes]:
    return [b"blk-" + tag + i.to_bytes(4, "little") for i in range(n)]


def _equal(cpu, a, b) -> bool:  # type: ignore[no-untyped-def]
    return all(np.array_equal(t.numpy()[a], t.numpy()[b]) for t in cpu)


@pytest.mark.asyncio
async def test_more_calls_than_connections_wait_instead_of_failing(tier_server) -> None:
    """32 concurrent fetches over a pool of 16 connections: the 17th waits for a free connection
    (within its deadline). Before: redis-py's MaxConnectionsError, mapped to "server down" with
    the backoff, and 0 of 128 blocks loaded."""
    ns = _ns()
    tier = SharedTier(tier_server.url, max_connections=16, single_tenant=True)
    cpu, bridge = random_bridge(tier, ns, 256, seed=1)
    keys = _keys(128)
    assert (await bridge.demote(keys, range(128))).all()
    groups = [range(i, i + 4) for i in range(0, 128, 4)]
    hits = await asyncio.gather(
        *(bridge.promote([keys[i] for i in g], [128 + i for i in g]) for g in groups)
    )
    assert sum(int(h.sum()) for h in hits) == 128
    assert _equal(cpu, list(range(128, 256)), list(range(128)))
    stats = tier.statistics()
    assert (stats.num_errors, stats.num_timeouts, stats.num_fail_fast) == (0, 0, 0)
    await tier.aclose()


@pytest.mark.asyncio
async def test_a_frozen_server_trips_the_breaker_and_hints_get_a_short_deadline(
    tier_server,
) -> None:
    """A frozen server (SIGSTOP: connected, silent) cost a full deadline on every call, every
    step. Now two timeouts in a row trip the breaker: later calls fail fast until the backoff
    ends and a probe finds the server back; lookups (hints) time out after hint_deadline_s."""
    ns = _ns()
    cpu = random_cpu_tensors(PAGES, 16, seed=2)
    tier = SharedTier(tier_server.url, deadline_s=0.5, hint_deadline_s=0.05,
                      reconnect_backoff_s=1.0, single_tenant=True)  # fmt: skip
    bridge = TierBridge(cpu, tier, ns)
    keys = _keys(4)
    assert (await bridge.demote(keys, range(4))).all()
    tier_server.freeze()
    try:
        t0 = time.perf_counter()
        with pytest.raises(TierTimeoutError):
            await tier.contains_many(ns.stored_keys(keys))  # a hint: its own short deadline
        hint_s = time.perf_counter() - t0
        assert hint_s < 0.3, hint_s
        with pytest.raises(TierTimeoutError):
            await tier.get_many(ns.stored_keys(keys))  # second timeout in a row: trips
        t1 = time.perf_counter()
        for _ in range(5):  # every step now: no network, no deadline spent
            assert not (await bridge.promote(keys, range(4, 8))).any()
        assert time.perf_counter() - t1 < 0.1
        assert tier.statistics().num_fail_fast == 5
    finally:
        tier_server.thaw()
    await asyncio.sleep(1.1)  # the backoff ends: the next call probes, and succeeds
    assert (await bridge.promote(keys, range(4, 8))).all()
    assert _equal(cpu, list(range(4, 8)), list(range(4)))
    await tier.aclose()


@pytest.mark.asyncio
async def test_a_black_holed_server_costs_two_deadlines_then_fails_fast() -> None:
    """A port that accepts connections and never answers (a black hole: the kernel's backlog of a
    socket nobody reads)."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    port = hole.getsockname()[1]
    tier = SharedTier(f"redis://127.0.0.1:{port}/0", deadline_s=0.2, reconnect_backoff_s=5.0,
                      single_tenant=True)  # fmt: skip
    try:
        for _ in range(2):
            with pytest.raises(TierTimeoutError):
                await tier.get_many([b"k"])
        t0 = time.perf_counter()
        for _ in range(10):
            with pytest.raises(TierUnavailableError, match="backing off"):
                await tier.get_many([b"k"])
        assert time.perf_counter() - t0 < 0.1
    finally:
        await tier.aclose()
        hole.close()


SPECIAL = "p#ss?w/rd:x@y%z"


@pytest.mark.asyncio
async def test_passwords_with_url_characters_work_and_never_show(tier_server_factory) -> None:
    """A password with # ? / : @ % in the URL: before, an untyped ValueError with the password
    in clear; now it authenticates, and no error shows it."""
    server = tier_server_factory("--requirepass", SPECIAL, admin={"password": SPECIAL})
    ns = _ns()
    cpu = random_cpu_tensors(PAGES, 8, seed=3)
    tier = SharedTier(f"redis://:{SPECIAL}@127.0.0.1:{server.port}/0", single_tenant=True)
    assert SPECIAL not in repr(tier) + tier.url
    bridge = TierBridge(cpu, tier, ns)
    assert (await bridge.demote(_keys(2), [0, 1])).all()
    assert (await bridge.promote(_keys(2), [2, 3])).all()
    await tier.aclose()
    for bad in (f"redis://u:{SPECIAL}@127.0.0.1:99999/0", f"redis://u:{SPECIAL}@127.0.0.1:1/x",
                f"redis://u:{SPECIAL}@/0", f"redis://u:{SPECIAL}@h:1/0?pw=1"):  # fmt: skip
        with pytest.raises(ConfigError) as info:
            SharedTier(bad, single_tenant=True)
        assert SPECIAL not in str(info.value) and "rd:x" not in str(info.value)


@pytest.mark.asyncio
async def test_tls_mistakes_are_refused_or_named(tier_server_factory, tmp_path) -> None:
    certs = make_certs(tmp_path)
    server = tls_server(tier_server_factory, certs, "optional")
    plain = tier_server_factory()
    tls_url = f"rediss://127.0.0.1:{server.port}/0"
    # a CA bundle with a plain URL used to connect in plaintext, silently
    with pytest.raises(ConfigError, match="rediss://"):
        SharedTier(f"redis://127.0.0.1:{plain.port}/0", ssl_ca_certs=certs["ca"])
    # ?ssl_cert_reqs=none used to turn verification off, silently
    with pytest.raises(ConfigError, match="TLS option"):
        SharedTier(tls_url + "?ssl_cert_reqs=none", single_tenant=True)
    # every failure read "ConnectionError"; now the reason is named
    untrusted = SharedTier(tls_url, single_tenant=True)
    with pytest.raises(TierUnavailableError, match="certificate was not accepted"):
        await untrusted.get_many([b"k"])
    to_plain = SharedTier(f"rediss://127.0.0.1:{plain.port}/0", ssl_ca_certs=certs["ca"],
                          connect_timeout_s=0.3, single_tenant=True)  # fmt: skip
    with pytest.raises(TierError, match="TLS handshake"):
        await to_plain.get_many([b"k"])
    for tier in (untrusted, to_plain):
        await tier.aclose()


@pytest.mark.asyncio
async def test_mutual_tls_with_a_client_certificate(tier_server_factory, tmp_path) -> None:
    certs = make_certs(tmp_path)
    server = tls_server(tier_server_factory, certs, "yes")
    url = f"rediss://127.0.0.1:{server.port}/0"
    without = SharedTier(url, ssl_ca_certs=certs["ca"], deadline_s=1.0, single_tenant=True)
    with pytest.raises(TierUnavailableError, match=r"TLS|closed"):
        await without.get_many([b"k"])
    await without.aclose()
    tier = SharedTier(url, ssl_ca_certs=certs["ca"], ssl_certfile=certs["client_crt"],
                      ssl_keyfile=certs["client_key"], single_tenant=True)  # fmt: skip
    cpu, bridge = random_bridge(tier, _ns(), 8, seed=4)
    assert (await bridge.demote(_keys(3), [0, 1, 2])).all()
    assert (await bridge.promote(_keys(3), [3, 4, 5])).all()
    assert _equal(cpu, [3, 4, 5], [0, 1, 2])
    await tier.aclose()
    with pytest.raises(ConfigError, match="TLS files"):
        SharedTier(url, ssl_ca_certs=certs["ca"], ssl_certfile=str(tmp_path / "missing.crt"))


def test_the_default_user_and_an_unsalted_namespace_warn(tier_server) -> None:
    with pytest.warns(TierSecurityWarning, match="default user"):
        tier = SharedTier(tier_server.url)
    with pytest.warns(TierSecurityWarning, match="tenant_salt"):
        TierBridge(random_cpu_tensors(PAGES, 2, seed=5), tier, _ns())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TierBridge(random_cpu_tensors(PAGES, 2, seed=5), tier, _ns(b"tenant-a"))
        SharedTier(tier_server.url, single_tenant=True)
        SharedTier(tier_server.url, username="kv", password_env=None)


@pytest.mark.asyncio
async def test_a_blob_planted_without_the_tenant_key_is_never_loaded(tier_server) -> None:
    """With write access but without tenant A's salt, B lists A's keys (SCAN) and replaces the
    values with KV of its own, correctly framed and checksummed: before, A loaded it; now A's
    MAC check rejects it (a miss), and so it does a value copied from another of A's keys."""
    ns_a = _ns(b"salt-of-tenant-a")
    cpu = random_cpu_tensors(PAGES, 16, seed=6)
    tier = SharedTier(tier_server.url, single_tenant=True)
    bridge = TierBridge(cpu, tier, ns_a)
    keys = _keys(4)
    assert (await bridge.demote(keys, range(4))).all()
    stolen = [bytes(k) for k in tier_server.command("KEYS", "kvmgr:*")]
    assert sorted(stolen) == sorted(ns_a.stored_keys(keys))
    forger = _ns()  # the same model and layout (public), no salt
    planted = np.random.default_rng(7).integers(0, 256, (3, ns_a.blob_bytes), dtype=np.uint8)
    encode_rows(planted, stolen[:3], forger)
    for key, row in zip(stolen[:3], planted):
        tier_server.command("SET", key, row.tobytes())
    tier_server.command("SET", stolen[3], tier_server.command("GET", stolen[0]))
    hit = await bridge.promote(keys, range(8, 12))
    assert not hit.any()
    assert bridge.statistics().num_corrupt == 4
    await tier.aclose()


@pytest.mark.asyncio
async def test_the_documented_acl_isolates_tenants(tier_server_factory) -> None:
    server = tier_server_factory("--requirepass", "admin", admin={"password": "admin"})
    for name in ("ta", "tb"):
        server.command("ACL", "SETUSER", name, "on", f">pw-{name}", f"~kvmgr:{name}:*",
                       "resetchannels", "-@all", "+get", "+set", "+exists", "+unlink")  # fmt: skip
    ns_a = TierNamespace("m", PAGES, ("bfloat16", "uint8"), 16, b"salt-a", b"kvmgr:ta:")
    ns_b = TierNamespace("m", PAGES, ("bfloat16", "uint8"), 16, b"salt-b", b"kvmgr:tb:")
    tier_a_pw = SharedTier(f"redis://ta:pw-ta@127.0.0.1:{server.port}/0")
    tier_b = SharedTier(f"redis://tb:pw-tb@127.0.0.1:{server.port}/0")
    cpu = random_cpu_tensors(PAGES, 8, seed=8)
    assert (await TierBridge(cpu, tier_a_pw, ns_a).demote(_keys(2), [0, 1])).all()
    # B can neither list nor read A's keys, even knowing them
    raw_b = redis.Redis(port=server.port, username="tb", password="pw-tb")
    with pytest.raises(redis.exceptions.NoPermissionError):
        raw_b.scan()
    raw_b.close()
    with pytest.raises(TierError, match="ACL"):
        await tier_b.get_many(ns_a.stored_keys(_keys(2)))
    with pytest.raises(TierError, match="ACL"):
        await tier_b.put_many(ns_a.stored_keys(_keys(1)), [b"x" * 64])
    assert (await TierBridge(cpu, tier_a_pw, ns_a).promote(_keys(2), [2, 3])).all()
    assert _equal(cpu, [2, 3], [0, 1])
    assert (await TierBridge(cpu, tier_b, ns_b).demote(_keys(2), [4, 5])).all()
    for tier in (tier_a_pw, tier_b):
        await tier.aclose()


@pytest.mark.asyncio
async def test_write_through_and_write_back_send_each_block_once(tier_server) -> None:
    """Before: every block went out twice (write-through on store, write-back on eviction)."""
    import torch

    kv = [torch.randn(64, 4, 256) for _ in range(2)]  # 4 KiB pages
    ns = TierNamespace("once", (4096, 4096), ("float32", "float32"), 4)
    tier = SharedTier(tier_server.url, single_tenant=True)
    config = ManagerConfig(num_cpu_blocks=8, tier_write_through=True, tier_write_back=True)
    keys = _keys(32, b"once")
    async with OffloadManager(kv, config, tiers=[tier], tier_namespace=ns) as mgr:
        src = mgr.allocate("a", 32)
        for lo in range(0, 32, 8):  # each store evicts the previous 8 blocks: write-back
            future = mgr.swap_out(src[lo : lo + 8], keys[lo : lo + 8])
            await mgr.step()
            await future
            await mgr._tiers.drain(10.0)  # type: ignore[union-attr]
        await mgr._tiers.drain(10.0)  # type: ignore[union-attr]
    info = tier_server.command("INFO", "commandstats")
    writes = sum(info.get(c, {}).get("calls", 0) for c in ("cmdstat_set", "cmdstat_mset"))
    assert writes == 32, writes  # (MSET counted once per call: 1,266 writes for ~672 keys)
    stats = tier.statistics()
    assert stats.num_stored == 32 and stats.bytes_written == 32 * ns.blob_bytes
    assert stats.num_already_present == 24  # the write-backs of blocks written through
    await tier.aclose()


@pytest.mark.asyncio
async def test_a_write_keeps_the_ttl_another_writer_set(tier_server) -> None:
    """MSET dropped a TTL another writer had set; SET .. NX keeps the key and its TTL."""
    ns = _ns()
    cpu = random_cpu_tensors(PAGES, 8, seed=9)
    with_ttl = SharedTier(tier_server.url, ttl_s=600, single_tenant=True)
    without = SharedTier(tier_server.url, single_tenant=True, skip_present=False)
    keys = _keys(3)
    assert (await TierBridge(cpu, with_ttl, ns).demote(keys, [0, 1, 2])).all()
    assert (await TierBridge(cpu, without, ns).demote(keys, [3, 4, 5])).all()
    for key in ns.stored_keys(keys):
        assert 0 < int(tier_server.command("PTTL", key)) <= 600_000
    assert (await TierBridge(cpu, without, ns).promote(keys, [6, 7, 3])).all()
    assert _equal(cpu, [6, 7, 3], [0, 1, 2])  # the first writer's blocks
    for tier in (with_ttl, without):
        await tier.aclose()
