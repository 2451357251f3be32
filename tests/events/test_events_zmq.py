"""The ZMQ publisher (issue 28 part 3) against real ZMQ sockets and vLLM's own classes.

1. The stream: a SUB socket receives ``topic, seq, payload`` per batch, seq from 0 in steps of
   one, payloads that vLLM's decoder reads; the frames equal those vLLM's own
   ``ZmqEventPublisher`` sends for the same batch.
2. Replay: a DEALER asking the ROUTER endpoint for ``seq >= n`` gets the buffered batches from
   ``n`` (at most ``buffer_steps``), then vLLM's end marker.
3. Data-parallel ranks: endpoints offset as vLLM offsets them; the rank stamped in each batch.
4. ``forward_events``: a manager's stream published as it happens, ending with the clear.
5. Lifecycle: close is idempotent, ``publish`` after it raises ``ClosedError``, bad arguments
   raise ``ConfigError``.

Connections are real (tcp on 127.0.0.1 and ipc in a temporary directory). PUB drops messages
sent before a subscriber's subscription arrives, so each test first publishes probe batches
until one is received (``_joined``), the way any PUB/SUB client synchronises.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq
from vllm_events_support import vllm_kv_events

from kvmgr import ClosedError, ConfigError, ManagerConfig, OffloadManager
from kvmgr.events import VllmEventFormat, ZmqEventPublisher, forward_events
from kvmgr.events.zmq_publisher import END_OF_REPLAY, offset_endpoint
from kvmgr.reports import KVEvent

K = [hashlib.sha256(f"z{i}".encode()).digest() for i in range(16)]
PROBE = [KVEvent("removed", (b"probe",))]
DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def ve() -> Any:
    return vllm_kv_events()


@pytest.fixture
def ctx() -> Any:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _sub(ctx: Any, endpoint: str, topic: str = "") -> Any:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt_string(zmq.SUBSCRIBE, topic)
    sock.connect(endpoint.replace("0.0.0.0", "127.0.0.1"))
    return sock


def _recv(sock: Any, timeout_s: float = DEADLINE_S) -> list[bytes]:
    if not sock.poll(int(timeout_s * 1000)):
        raise AssertionError(f"nothing received within {timeout_s} s")
    return sock.recv_multipart()


def _joined(publish: Any, sub: Any) -> int:
    """Publish probes until the subscriber gets one; returns the next sequence number."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        publish()
        if sub.poll(50):
            last = int.from_bytes(sub.recv_multipart()[1], "big")
            while sub.poll(200):  # probes still in flight
                last = int.from_bytes(sub.recv_multipart()[1], "big")
            return last + 1
    raise AssertionError("the subscriber never joined")


def _events() -> list[KVEvent]:
    tokens = np.arange(8, dtype=np.int32).reshape(2, 4)
    return [
        KVEvent("removed", (K[5],)),
        KVEvent("stored", (K[0], K[1]), "cpu", (None, K[0]), tokens),
    ]


# ====================================================================== 1. the stream


def test_a_subscriber_gets_topic_seq_payload_that_vllm_decodes(ve: Any, ctx: Any) -> None:
    fmt = VllmEventFormat(block_size=4)
    with ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv", event_format=fmt, context=ctx) as pub:
        sub = _sub(ctx, pub.endpoint, "kv")
        first = _joined(lambda: pub.publish(PROBE), sub)
        for i in range(3):
            pub.publish(_events(), ts=100.0 + i)
        decoder = msgspec.msgpack.Decoder(type=ve.KVEventBatch)
        for i in range(3):
            topic, seq, payload = _recv(sub)
            assert topic == b"kv" and len(seq) == 8
            assert int.from_bytes(seq, "big") == first + i
            batch = decoder.decode(payload)
            assert batch.ts == 100.0 + i and batch.data_parallel_rank == 0
            removed, stored = batch.events
            assert isinstance(removed, ve.BlockRemoved) and isinstance(stored, ve.BlockStored)
            assert stored.token_ids == list(range(8)) and stored.block_size == 4
        sub.close()


def test_the_frames_are_those_of_vllms_own_publisher(ve: Any, tmp_path: Path) -> None:
    # vLLM's publisher uses zmq.Context.instance(); ours is given the same context
    ctx = zmq.Context.instance()
    fmt = VllmEventFormat(block_size=4)
    h = fmt.block_hash
    theirs_events = [
        ve.BlockRemoved(block_hashes=[h(K[5])], medium="CPU"),
        ve.BlockStored(
            block_hashes=[h(K[0]), h(K[1])],
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=4,
            lora_id=None,
            medium="CPU",
            lora_name=None,
        ),
    ]
    frames = []
    for side in ("vllm", "kvmgr"):
        endpoint = f"ipc://{tmp_path}/{side}.sock"
        sub = _sub(ctx, endpoint, "kv-events")
        if side == "vllm":
            theirs = ve.ZmqEventPublisher(0, endpoint=endpoint, topic="kv-events")
            try:
                seq = _joined(lambda p=theirs: p.publish(ve.KVEventBatch(ts=1.0, events=[])), sub)
                theirs.publish(ve.KVEventBatch(ts=7.5, events=theirs_events))
                got = _recv(sub)
            finally:
                theirs.shutdown()
        else:
            with ZmqEventPublisher(endpoint, topic="kv-events", event_format=fmt,
                                   context=ctx) as ours:  # fmt: skip
                seq = _joined(lambda p=ours: p.publish(PROBE), sub)
                ours.publish(_events(), ts=7.5)
                got = _recv(sub)
        sub.close()
        assert int.from_bytes(got[1], "big") == seq
        frames.append((got[0], got[2]))
    assert frames[0] == frames[1]  # same topic frame, same payload bytes


# ====================================================================== 2. replay


def test_replay_sends_buffered_batches_from_the_asked_seq_then_the_end_marker(
    ve: Any, ctx: Any
) -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                           topic="t", buffer_steps=3, context=ctx) as pub:  # fmt: skip
        assert pub.replay_endpoint is not None
        sub = _sub(ctx, pub.endpoint)
        first = _joined(lambda: pub.publish(PROBE), sub)
        for i in range(4):  # seq first .. first+3; the buffer keeps the last 3
            pub.publish([KVEvent("removed", (K[i],))], ts=float(i))
        for _ in range(4):
            _recv(sub)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        decoder = msgspec.msgpack.Decoder(type=ve.KVEventBatch)

        def replay(start: int) -> list[int]:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            seqs = []
            while True:
                empty, topic, seq, payload = _recv(dealer)
                assert empty == b""
                if seq == END_OF_REPLAY:
                    assert topic == b"" and payload == b""
                    return seqs
                assert topic == b"t"
                seqs.append(int.from_bytes(seq, "big"))
                (event,) = decoder.decode(payload).events
                assert event.block_hashes == [fmt_hash(K[seqs[-1] - first])]

        fmt_hash = VllmEventFormat().block_hash
        assert replay(first + 2) == [first + 2, first + 3]
        assert replay(0) == [first + 1, first + 2, first + 3]  # the oldest left the buffer
        assert replay(first + 9) == []
        dealer.close()
        sub.close()


# ====================================================================== 3. data-parallel ranks


def test_endpoints_are_offset_by_rank_as_vllm_offsets_them(ve: Any, ctx: Any) -> None:
    for endpoint in ("tcp://*:5557", "tcp://10.0.0.1:6000", "tcp://*:0", "inproc://cache"):
        for rank in (0, 1, 3):
            assert offset_endpoint(endpoint, rank) == ve.ZmqEventPublisher.offset_endpoint_port(
                endpoint, rank
            )
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"
    with pytest.raises(ConfigError):
        offset_endpoint("udp://x:1", 0)
    with ZmqEventPublisher("inproc://kv-rank", data_parallel_rank=2, context=ctx) as pub:
        assert pub.endpoint == "inproc://kv-rank_dp2"
        sub = _sub(ctx, pub.endpoint)
        _joined(lambda: pub.publish(PROBE), sub)
        pub.publish(_events())
        batch = msgspec.msgpack.Decoder(type=ve.KVEventBatch).decode(_recv(sub)[2])
        assert batch.data_parallel_rank == 2
        sub.close()


# ====================================================================== 4. forward_events


@pytest.mark.asyncio
async def test_forward_events_publishes_a_managers_stream_until_close(ve: Any, ctx: Any) -> None:
    gen = torch.Generator().manual_seed(5)
    kv = [torch.randint(1, 256, (8, 64), dtype=torch.uint8, generator=gen) for _ in range(2)]
    cfg = ManagerConfig(num_cpu_blocks=2, engine="host", manage_gpu_blocks=False)
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", event_format=VllmEventFormat(block_size=4),
                            context=ctx)  # fmt: skip
    sub = _sub(ctx, pub.endpoint)
    await asyncio.to_thread(_joined, lambda: pub.publish(PROBE), sub)
    async with OffloadManager(kv, cfg) as mgr:
        task = asyncio.ensure_future(forward_events(mgr, pub))
        tokens = np.arange(8).reshape(2, 4)
        st = mgr.swap_out([0, 1], K[:2], token_ids=tokens)
        await mgr.step()
        await st
        st = mgr.swap_out([2], [K[2]])  # evicts K1 (the chain's leaf)
        await mgr.step()
        await st
    assert await asyncio.wait_for(task, timeout=DEADLINE_S) >= 2
    pub.close()
    decoder = msgspec.msgpack.Decoder(type=ve.KVEventBatch)
    events = []
    while sub.poll(1000):
        events += decoder.decode(sub.recv_multipart()[2]).events
    sub.close()
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["BlockStored", "BlockRemoved", "BlockStored", "AllBlocksCleared"]
    h = VllmEventFormat().block_hash
    assert events[0].block_hashes == [h(K[0]), h(K[1])] and events[0].token_ids == list(range(8))
    assert events[1].block_hashes == [h(K[1])]
    assert events[2].block_hashes == [h(K[2])] and events[2].token_ids == []


# ====================================================================== 5. lifecycle


def test_close_is_idempotent_and_publish_after_close_raises(ctx: Any) -> None:
    pub = ZmqEventPublisher("inproc://kv-close", context=ctx)
    pub.publish([])  # an empty batch sends nothing
    pub.close()
    pub.close()
    with pytest.raises(ClosedError):
        pub.publish(PROBE)
    assert pub.num_published == 0
    for bad in ({"buffer_steps": 0}, {"hwm": -1}, {"max_queue_size": 1.5}):
        with pytest.raises(ConfigError):
            ZmqEventPublisher("inproc://kv-bad", context=ctx, **bad)  # type: ignore[arg-type]
