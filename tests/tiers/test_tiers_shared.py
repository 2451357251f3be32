"""SharedTier and TierBridge against a real Valkey/Redis server (no mock stands in for it).

Each test starts its own server on a free port (tests/tiers_server.py); without the binary the
tests skip, or fail under ``KVMGR_REQUIRE_TIER_SERVER=1`` (CI).
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest
import torch

pytest.importorskip("redis")

from tiers_server import make_certs, random_bridge, random_cpu_tensors, tls_server

from kvmgr.errors import (
    ConfigError,
    TierFullError,
    TierTimeoutError,
    TierUnavailableError,
)
from kvmgr.tiers import SharedTier, TierBridge, TierNamespace

PAGES = (1152, 584, 300)  # MLA row, DeepSeek-V4 token, an odd size
NUM_BLOCKS = 24


def _namespace(**kw: object) -> TierNamespace:
    args: dict[str, object] = {
        "model": "test/model",
        "page_bytes": PAGES,
        "dtype_names": ("bfloat16", "uint8", "uint8"),
        "block_size": 16,
    }
    args.update(kw)
    return TierNamespace(**args)  # type: ignore[arg-type]


def _keys(n: int, tag: bytes = b"") -> list[bytes]:
    return [b"prompt-" + tag + i.to_bytes(4, "little") for i in range(n)]


def _blocks(tensors: list[torch.Tensor], ids: list[int]) -> list[np.ndarray]:
    return [t.numpy()[ids].copy() for t in tensors]


def _equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.asyncio
async def test_round_trip_between_two_instances(tier_server) -> None:
    # two instances: each its own CPU tier and its own client, one server, one namespace
    ns = _namespace()
    cpu_a = random_cpu_tensors(PAGES, NUM_BLOCKS, seed=1)
    cpu_b = random_cpu_tensors(PAGES, NUM_BLOCKS, seed=2)
    tier_a, tier_b = (
        SharedTier(tier_server.url, single_tenant=True),
        SharedTier(tier_server.url, single_tenant=True),
    )
    bridge_a, bridge_b = TierBridge(cpu_a, tier_a, ns), TierBridge(cpu_b, tier_b, ns)
    keys = _keys(8)
    src_ids, dst_ids = [3, 0, 7, 9, 11, 2, 20, 5], [1, 4, 6, 8, 10, 12, 14, 16]
    # A demotes 8 blocks in one batch
    stored = await bridge_a.demote(keys, src_ids)
    assert stored.all()
    assert int(tier_server.command("DBSIZE")) == 8
    # B sees them, and 2 unknown keys are not there
    probe = await tier_b.contains_many(ns.stored_keys([*keys[:3], b"other-1", b"other-2"]))
    assert probe.tolist() == [True, True, True, False, False]
    # B promotes them into other CPU blocks: bytes equal A's; the rest of B untouched
    before = _blocks(cpu_b, [0, 2])
    hit = await bridge_b.promote(keys, dst_ids)
    assert hit.all()
    assert _equal(_blocks(cpu_b, dst_ids), _blocks(cpu_a, src_ids))
    assert _equal(_blocks(cpu_b, [0, 2]), before)
    stats_b = tier_b.statistics()
    assert (stats_b.num_hits, stats_b.num_misses, stats_b.num_corrupt) == (8, 0, 0)
    assert stats_b.num_get_batches == 1 and stats_b.bytes_read == 8 * ns.blob_bytes
    assert stats_b.io_mode == "resp"
    assert bridge_b.statistics().num_promoted == 8
    await tier_a.aclose()
    await tier_b.aclose()


@pytest.mark.asyncio
async def test_one_round_trip_per_batch(tier_server) -> None:
    # a batch of 40 blocks is one pipeline on one connection each way (the store's EXISTS adds
    # one round trip): the server counts the commands and the connections
    ns = _namespace()
    tier = SharedTier(tier_server.url, single_tenant=True)
    _, bridge = random_bridge(tier, ns, 48, seed=3)
    tier_server.command("CONFIG", "RESETSTAT")
    await bridge.demote(_keys(40), list(range(40)))
    await bridge.promote(_keys(40), list(range(40)))
    info = tier_server.command("INFO", "commandstats")
    calls = {k: v["calls"] for k, v in info.items() if k in ("cmdstat_exists", "cmdstat_set",
                                                              "cmdstat_get", "cmdstat_mget")}  # fmt: skip
    assert calls == {"cmdstat_exists": 40, "cmdstat_set": 40, "cmdstat_get": 40}, calls
    clients = tier_server.command("CLIENT", "LIST").decode().splitlines()
    assert sum(" cmd=get " in c for c in clients) == 1  # the tier's one connection
    await tier.aclose()


@pytest.mark.asyncio
async def test_other_layout_or_model_never_reads(tier_server) -> None:
    tier = SharedTier(tier_server.url, single_tenant=True)
    _, bridge = random_bridge(tier, _namespace(), NUM_BLOCKS, seed=4)
    await bridge.demote(_keys(4), [0, 1, 2, 3])
    for other in (_namespace(block_size=32), _namespace(model="other/model"),
                  _namespace(dtype_names=("float16", "uint8", "uint8"))):  # fmt: skip
        dst = random_cpu_tensors(PAGES, NUM_BLOCKS, seed=5)
        before = _blocks(dst, [4, 5, 6, 7])
        hit = await TierBridge(dst, tier, other).promote(_keys(4), [4, 5, 6, 7])
        assert not hit.any()
        assert _equal(_blocks(dst, [4, 5, 6, 7]), before)
    await tier.aclose()


@pytest.mark.asyncio
async def test_tenants_with_equal_prompts_share_nothing(tier_server) -> None:
    # tenants A and B store the same prompt keys: two disjoint key sets on the server
    ns_a, ns_b = _namespace(tenant_salt=b"tenant-a"), _namespace(tenant_salt=b"tenant-b")
    keys = _keys(6)
    assert not set(ns_a.stored_keys(keys)) & set(ns_b.stored_keys(keys))
    tier = SharedTier(tier_server.url, single_tenant=True)
    cpu_a = random_cpu_tensors(PAGES, NUM_BLOCKS, seed=6)
    await TierBridge(cpu_a, tier, ns_a).demote(keys, list(range(6)))
    # B cannot read A's blocks, and cannot even see that they exist
    cpu_b = random_cpu_tensors(PAGES, NUM_BLOCKS, seed=7)
    bridge_b = TierBridge(cpu_b, tier, ns_b)
    assert not (await tier.contains_many(ns_b.stored_keys(keys))).any()
    assert not (await bridge_b.promote(keys, list(range(6, 12)))).any()
    # once B stores its own, the server holds both sets, each tenant reads its own bytes
    await bridge_b.demote(keys, list(range(6)))
    assert int(tier_server.command("DBSIZE")) == 12
    dst = random_cpu_tensors(PAGES, NUM_BLOCKS, seed=8)
    assert (await TierBridge(dst, tier, ns_a).promote(keys, list(range(6)))).all()
    assert _equal(_blocks(dst, list(range(6))), _blocks(cpu_a, list(range(6))))
    await tier.aclose()


@pytest.mark.asyncio
async def test_corrupt_truncated_or_moved_values_are_misses(tier_server) -> None:
    ns = _namespace()
    tier = SharedTier(tier_server.url, single_tenant=True)
    cpu, bridge = random_bridge(tier, ns, NUM_BLOCKS, seed=9)
    keys = _keys(5)
    await bridge.demote(keys, [0, 1, 2, 3, 4])
    sk = ns.stored_keys(keys)
    # tamper in the server: flip a payload byte, truncate, move a value under another key,
    # replace one with garbage
    value1 = tier_server.command("GET", sk[1])
    tier_server.command("SETRANGE", sk[0], 700, bytes([value1[700] ^ 0xFF]))
    tier_server.command("SET", sk[1], value1[:-1])
    tier_server.command("SET", sk[2], tier_server.command("GET", sk[3]))
    tier_server.command("SET", sk[4], b"not a blob")
    dst = random_cpu_tensors(PAGES, NUM_BLOCKS, seed=10)
    before = _blocks(dst, [10, 11, 12, 13, 14])
    bridge = TierBridge(dst, tier, ns)
    hit = await bridge.promote(keys, [10, 11, 12, 13, 14])
    # only the untouched key 3 loads; the values of another length (truncated, garbage) never
    # touched their blocks (a same-length tampered value was received in place and rejected)
    assert hit.tolist() == [False, False, False, True, False]
    after = _blocks(dst, [10, 11, 12, 13, 14])
    for i in (1, 4):
        assert all(np.array_equal(a[i], b[i]) for a, b in zip(after, before))
    assert _equal(_blocks(dst, [13]), _blocks(cpu, [3]))
    stats = tier.statistics()
    assert (stats.num_corrupt, stats.num_hits, stats.num_misses) == (4, 1, 4)
    assert bridge.statistics().num_corrupt == 2  # flipped byte, moved value: the checksum
    await tier.aclose()


@pytest.mark.asyncio
async def test_server_killed_then_restarted(tier_server) -> None:
    ns = _namespace()
    tier = SharedTier(tier_server.url, deadline_s=1.0, reconnect_backoff_s=0.0, single_tenant=True)
    cpu, bridge = random_bridge(tier, ns, NUM_BLOCKS, seed=11)
    keys = _keys(4)
    assert (await bridge.demote(keys, [0, 1, 2, 3])).all()
    # crash: calls fail fast with a typed error; the bridge turns them into misses
    tier_server.kill()
    start = time.perf_counter()
    with pytest.raises(TierUnavailableError):
        await tier.get_many(ns.stored_keys(keys))
    before = _blocks(cpu, [5, 6, 7, 8])
    assert not (await bridge.promote(keys, [5, 6, 7, 8])).any()
    assert not (await bridge.demote(_keys(2, b"x"), [9, 10])).any()
    assert time.perf_counter() - start < 2.0
    assert _equal(_blocks(cpu, [5, 6, 7, 8]), before)
    stats = tier.statistics()
    assert stats.num_errors == 3 and stats.last_error is not None
    # restart on the same port (persistence off: empty); the client reconnects by itself
    tier_server.start()
    assert not (await bridge.promote(keys, [5, 6, 7, 8])).any()
    assert (await bridge.demote(keys, [0, 1, 2, 3])).all()
    assert (await bridge.promote(keys, [5, 6, 7, 8])).all()
    assert _equal(_blocks(cpu, [5, 6, 7, 8]), _blocks(cpu, [0, 1, 2, 3]))
    await tier.aclose()


@pytest.mark.asyncio
async def test_down_server_backs_off_without_network(tier_server) -> None:
    tier = SharedTier(tier_server.url, reconnect_backoff_s=30.0, single_tenant=True)
    tier_server.kill()
    with pytest.raises(TierUnavailableError):
        await tier.contains_many([b"k"])
    with pytest.raises(TierUnavailableError, match="backing off"):
        await tier.get_many([b"k"])
    await tier.aclose()


@pytest.mark.asyncio
async def test_slow_server_deadline_expires_no_hang(tier_server) -> None:
    ns = _namespace()
    tier = SharedTier(tier_server.url, deadline_s=0.25, single_tenant=True)
    cpu, bridge = random_bridge(tier, ns, NUM_BLOCKS, seed=12)
    keys = _keys(3)
    await bridge.demote(keys, [0, 1, 2])
    # the server stops answering for 1.5 s; our calls give up at their deadline
    tier_server.command("CLIENT", "PAUSE", "1500", "ALL")
    start = time.perf_counter()
    with pytest.raises(TierTimeoutError) as info:
        await tier.get_many(ns.stored_keys(keys))
    assert not isinstance(info.value, TimeoutError)
    assert not (await bridge.promote(keys, [3, 4, 5])).any()
    assert not (await bridge.demote(_keys(2, b"w"), [6, 7])).any()
    assert time.perf_counter() - start < 1.2
    # two timeouts in a row trip the breaker: the third call fails fast (issue 26)
    stats = tier.statistics()
    assert (stats.num_timeouts, stats.num_fail_fast) == (2, 1)
    # once the pause ends (a blocking PING returns then), calls succeed with the right bytes:
    # no reply of a cancelled call is read as the answer to a later one
    await asyncio.to_thread(tier_server.command, "PING")
    assert (await bridge.promote(keys, [3, 4, 5])).all()
    assert _equal(_blocks(cpu, [3, 4, 5]), _blocks(cpu, [0, 1, 2]))
    await tier.aclose()


@pytest.mark.asyncio
async def test_server_memory_full(tier_server_factory) -> None:
    # maxmemory with noeviction: writes past the limit fail typed, stored blocks stay readable
    server = tier_server_factory("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    ns = _namespace()
    tier = SharedTier(server.url, single_tenant=True)
    _, bridge = random_bridge(tier, ns, 64, seed=13)
    first = _keys(4, b"a")
    assert (await bridge.demote(first, [0, 1, 2, 3])).all()
    with pytest.raises(TierFullError):
        for batch in range(1, 250):  # 8 x 16 KiB a batch: 4 MB fill up within ~ 32 batches
            await tier.put_many(ns.stored_keys(_keys(8, bytes([batch]))), [b"\x01" * 16384] * 8)
    assert tier.statistics().num_full >= 1
    # (used memory can dip below the limit once the failed command's buffer is freed; lower
    # the limit under what is stored so that every further write is refused)
    used = int(server.command("INFO", "memory")["used_memory"])
    server.command("CONFIG", "SET", "maxmemory", str(used // 2))
    assert not (await bridge.demote(_keys(4, b"b"), [4, 5, 6, 7])).any()
    assert (await bridge.promote(first, [8, 9, 10, 11])).all()
    await tier.aclose()


@pytest.mark.asyncio
async def test_server_eviction_is_a_miss(tier_server_factory) -> None:
    # allkeys-lru: the server drops old blocks to make room; those are plain misses
    server = tier_server_factory("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    ns = _namespace()
    tier = SharedTier(server.url, ttl_s=600, single_tenant=True)
    _, bridge = random_bridge(tier, ns, 64, seed=14)
    for batch in range(40):  # 40 x 64 x ~2 KiB = 5.3 MB into 2 MB
        assert (await bridge.demote(_keys(64, bytes([batch])), list(range(64)))).all()
    assert int(server.command("DBSIZE")) < 40 * 64
    hit = await bridge.promote(_keys(64, bytes([0])), list(range(64)))
    assert not hit.all()
    assert tier.statistics().num_errors == 0 and bridge.statistics().num_corrupt == 0
    # a key the server still holds (under maxmemory it may evict between the two commands:
    # PTTL of a key gone answers -2, so draw again)
    ttls = [int(server.command("PTTL", server.command("RANDOMKEY"))) for _ in range(20)]
    live = [ttl for ttl in ttls if ttl != -2]
    assert live and all(0 < ttl <= 600_000 for ttl in live), ttls
    await tier.aclose()


PASSWORD = "Sup3r-s3cret-Pa55word"


@pytest.mark.asyncio
async def test_acl_credentials_never_printed(tier_server_factory, tmp_path, monkeypatch,
                                             caplog, capsys) -> None:  # fmt: skip
    caplog.set_level(logging.DEBUG)
    server = tier_server_factory("--requirepass", "admin-pw", admin={"password": "admin-pw"})
    # the least-privilege user docs/tiers.md recommends
    server.command("ACL", "SETUSER", "kv", "on", f">{PASSWORD}", "~kvmgr:*", "resetchannels",
                   "-@all", "+get", "+set", "+exists", "+unlink")  # fmt: skip
    ns = _namespace()
    cpu = random_cpu_tensors(PAGES, NUM_BLOCKS, seed=15)
    host = f"127.0.0.1:{server.port}"
    pw_file = tmp_path / "pw"
    pw_file.write_text(PASSWORD + "\n")
    monkeypatch.setenv("KVMGR_TEST_PW", PASSWORD)
    tiers = [
        SharedTier(f"valkey://kv:{PASSWORD}@{host}/0", single_tenant=True),
        SharedTier(f"redis://{host}/0", username="kv", password_file=pw_file, single_tenant=True),
        SharedTier(
            f"redis://{host}/0", username="kv", password_env="KVMGR_TEST_PW", single_tenant=True
        ),
        SharedTier(f"redis://{host}/0?username=kv&password={PASSWORD}", single_tenant=True),
    ]
    texts = []
    for i, tier in enumerate(tiers):
        bridge = TierBridge(cpu, tier, ns)
        assert (await bridge.demote(_keys(2, bytes([i])), [0, 1])).all()
        assert (await bridge.promote(_keys(2, bytes([i])), [2, 3])).all()
        texts += [
            repr(tier),
            str(tier),
            tier.url,
            repr(tier.statistics()),
            repr(bridge.statistics()),
        ]
    # a wrong password: typed error, and the bridge logs a warning; neither shows the secret
    bad = SharedTier(f"redis://kv:wrong-{PASSWORD}@{host}/0", single_tenant=True)
    with pytest.raises(TierUnavailableError, match="authentication") as info:
        await bad.get_many([b"k"])
    assert not (await TierBridge(cpu, bad, ns).promote([b"k"], [0])).any()
    texts += [str(info.value), repr(info.value), repr(bad), repr(bad.statistics())]
    texts += [caplog.text, *capsys.readouterr()]
    assert "wrong-" + PASSWORD not in "\n".join(texts)
    assert PASSWORD not in "\n".join(texts)
    assert "promote of 1 blocks failed" in caplog.text  # logged, without the secret
    for tier in [*tiers, bad]:
        await tier.aclose()


def test_url_schemes_and_bad_urls() -> None:
    assert SharedTier("valkey://h:1/2", single_tenant=True).url == "redis://h:1/2"
    assert SharedTier("valkeys://u:p@h:1/0", single_tenant=True).url == "rediss://h:1/0"
    assert "p@" not in repr(SharedTier("rediss://u:p@h:1/0", single_tenant=True))
    in_query = SharedTier("redis://h:1/0?password=qs-Secret9&db=3", single_tenant=True)
    assert "qs-Secret9" not in repr(in_query) + in_query.url
    assert in_query.url == "redis://h:1/3"
    for bad in ("http://h:1", "h:1", "redis:///0", "redis://h:1/0?socket_keepalive=true"):
        with pytest.raises(ConfigError):
            SharedTier(bad, single_tenant=True)
    with pytest.raises(ConfigError, match="password file"):
        SharedTier("redis://h:1/0", password_file="/nonexistent/pw", single_tenant=True)


@pytest.mark.asyncio
async def test_tls_round_trip(tier_server_factory, tmp_path) -> None:
    # rediss:// to a TLS-only server (plain port off), server certificate checked against our CA
    certs = make_certs(tmp_path)
    ca = certs["ca"]
    server = tls_server(tier_server_factory, certs, "no")
    ns = _namespace()
    tier = SharedTier(f"rediss://127.0.0.1:{server.port}/0", ssl_ca_certs=ca, single_tenant=True)
    cpu, bridge = random_bridge(tier, ns, NUM_BLOCKS, seed=16)
    assert (await bridge.demote(_keys(3), [0, 1, 2])).all()
    assert (await bridge.promote(_keys(3), [3, 4, 5])).all()
    assert _equal(_blocks(cpu, [3, 4, 5]), _blocks(cpu, [0, 1, 2]))
    await tier.aclose()
    # without our CA the certificate is refused: a typed error, not a hang
    untrusted = SharedTier(f"valkeys://127.0.0.1:{server.port}/0", single_tenant=True)
    with pytest.raises(TierUnavailableError):
        await untrusted.get_many([b"k"])
    await untrusted.aclose()


def test_missing_server_skips_locally_and_fails_in_ci(monkeypatch) -> None:
    import tiers_server

    monkeypatch.setattr(tiers_server.shutil, "which", lambda _name: None)
    monkeypatch.delenv("KVMGR_REQUIRE_TIER_SERVER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y redis-server"):
        tiers_server.server_binary()
    monkeypatch.setenv("KVMGR_REQUIRE_TIER_SERVER", "1")
    with pytest.raises(pytest.fail.Exception, match="KVMGR_REQUIRE_TIER_SERVER=1"):
        tiers_server.server_binary()


@pytest.mark.asyncio
async def test_unix_socket_round_trip(tier_server_factory, tmp_path) -> None:
    sock = tmp_path / "kv.sock"
    server = tier_server_factory("--unixsocket", str(sock), "--unixsocketperm", "700")
    ns = _namespace()
    cpu = random_cpu_tensors(PAGES, NUM_BLOCKS, seed=17)
    tier = SharedTier(f"unix://{sock}", single_tenant=True)
    assert tier.url == f"unix://{sock}"
    bridge = TierBridge(cpu, tier, ns)
    assert (await bridge.demote(_keys(2), [0, 1])).all()
    assert int(server.command("DBSIZE")) == 2
    assert (await bridge.promote(_keys(2), [2, 3])).all()
    assert _equal(_blocks(cpu, [2, 3]), _blocks(cpu, [0, 1]))
    await tier.aclose()
