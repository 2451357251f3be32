"""A ZMQ publisher of kvmgr's KV events that speaks vLLM's protocol (PUB stream + ROUTER replay).

Offers:
    ZmqEventPublisher   a thread that converts, encodes and sends each published batch
    offset_endpoint     an endpoint moved to a data-parallel rank's port (or name)

The protocol, as vLLM's ``ZmqEventPublisher`` (0.33) has it, so that its subscribers work
unchanged:

- the PUB socket sends each batch as three frames: ``topic`` (UTF-8), the sequence number
  (8 bytes, big-endian, from 0, one per batch), the msgpack payload (``encode_batch``);
- the optional ROUTER socket answers a replay request (one frame: the first wanted sequence
  number, 8 bytes big-endian) with every buffered batch from that number on, each as
  ``topic, seq, payload``, then the end marker ``b"", (-1 as 8 signed big-endian bytes), b""``;
  the last ``buffer_steps`` batches are kept;
- an endpoint with a wildcard (``*``, ``::``) or an ``ipc://`` / ``inproc://`` one is bound,
  any other is connected to; rank ``r > 0`` moves a TCP port up by ``r`` (port 0 stays) and
  suffixes ``_dp{r}`` to an ``ipc``/``inproc`` name.

Conversion to vLLM's structs and encoding run on the publisher's thread, so the event loop only
queues the (immutable) ``KVEvent`` lists.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from kvmgr.errors import ClosedError, ConfigError
from kvmgr.events.vllm_format import VllmEventFormat, encode_batch
from kvmgr.reports import KVEvent

__all__ = ["END_OF_REPLAY", "ZmqEventPublisher", "offset_endpoint"]

_LOG = logging.getLogger(__name__)

#: The sequence frame that ends a replay.
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """``endpoint`` for data-parallel rank ``data_parallel_rank`` (see the module docstring).

    Raises:
        ConfigError: a negative rank, or an endpoint that is not ``tcp``, ``ipc`` or ``inproc``.
    """
    if data_parallel_rank < 0:
        raise ConfigError(f"expected data_parallel_rank >= 0, got {data_parallel_rank}")
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"expected a tcp://, ipc:// or inproc:// endpoint, got {endpoint!r}")
    if data_parallel_rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, _, port = endpoint.rpartition(":")
    if port in ("0", "*"):
        return endpoint
    try:
        return f"{base}:{int(port) + data_parallel_rank}"
    except ValueError:
        raise ConfigError(f"expected a numeric port in {endpoint!r}") from None


def _check_arguments(
    buffer_steps: int, hwm: int, max_queue_size: int, topic: str, rank: int, event_format: object
) -> None:
    """``ZmqEventPublisher``'s argument checks. Raises ConfigError: a bad one."""
    for name, value in (("buffer_steps", buffer_steps), ("hwm", hwm),
                        ("max_queue_size", max_queue_size)):  # fmt: skip
        if type(value) is not int or value < 1:
            raise ConfigError(f"expected {name} to be an int >= 1, got {value!r}")
    if not isinstance(topic, str):
        raise ConfigError(f"expected topic to be a str, got {topic!r}")
    if type(rank) is not int:  # bools refused; offset_endpoint checks >= 0
        raise ConfigError(f"expected data_parallel_rank to be an int, got {rank!r}")
    if event_format is not None and not isinstance(event_format, VllmEventFormat):
        raise ConfigError(f"expected a VllmEventFormat or None, got {event_format!r:.80}")


def _is_bind(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes batches of ``KVEvent`` on a ZMQ PUB socket in vLLM's format, with replay.

    Args:
        endpoint: PUB endpoint (bound or connected, see the module docstring), before the rank
            offset. ``tcp://*:5557`` is vLLM's default.
        replay_endpoint: ROUTER endpoint for replay requests (always bound), or ``None``.
        topic: the first frame of every message; subscribers filter on its prefix.
        buffer_steps: batches kept for replay (``>= 1``).
        hwm: the PUB socket's send high-water mark (messages beyond it are dropped by ZMQ).
        max_queue_size: batches waiting for the thread; ``publish`` blocks when it is full.
        data_parallel_rank: stamped into every batch and applied to the endpoints.
        event_format: how events become vLLM structs; ``VllmEventFormat()`` by default.
        context: the ZMQ context; ``zmq.Context.instance()`` by default.

    Attributes:
        endpoint / replay_endpoint: the endpoints in use (a bound wildcard port resolved).
        num_published: batches sent so far (the next sequence number).

    Raises:
        ConfigError: a bad argument. zmq.ZMQError: an endpoint could not be bound or connected.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        data_parallel_rank: int = 0,
        event_format: VllmEventFormat | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        _check_arguments(buffer_steps, hwm, max_queue_size, topic, data_parallel_rank, event_format)
        self._format = event_format or VllmEventFormat()
        self._rank = data_parallel_rank
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[tuple[Sequence[KVEvent], float] | None] = queue.Queue(
            maxsize=max_queue_size
        )
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self.num_published = 0
        self._closed = False
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[Any] | None = None
        try:
            self._pub.set_hwm(hwm)
            self.endpoint = self._attach(self._pub, offset_endpoint(endpoint, self._rank))
            self.replay_endpoint = self._bind_replay(ctx, replay_endpoint, buffer_steps)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kvmgr-kv-events", daemon=True)
        self._thread.start()

    def _bind_replay(
        self, ctx: zmq.Context[Any], replay_endpoint: str | None, buffer_steps: int
    ) -> str | None:
        """Bind the ROUTER socket of replay requests (none without ``replay_endpoint``)."""
        if replay_endpoint is None:
            return None
        self._replay = ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # a full replay
        target = offset_endpoint(replay_endpoint, self._rank)
        self._replay.bind(target)
        return self._last_endpoint(self._replay, target)

    def _attach(self, sock: zmq.Socket[Any], endpoint: str) -> str:
        if not _is_bind(endpoint):
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
        return self._last_endpoint(sock, endpoint)

    @staticmethod
    def _last_endpoint(sock: zmq.Socket[Any], endpoint: str) -> str:
        if endpoint.startswith("tcp://"):
            return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        return endpoint

    # ------------------------------------------------------------------ caller side

    def publish(self, events: Sequence[KVEvent], *, ts: float | None = None) -> None:
        """Queue one batch (nothing is sent for an empty one). Returns at once unless
        ``max_queue_size`` batches already wait (then it blocks until one is sent).

        Args:
            events: in order; kept by reference until sent (``KVEvent`` is immutable).
            ts: the batch's wall-clock time in seconds since the epoch; now if ``None``.

        Raises:
            ClosedError: the publisher is closed.
        """
        if self._closed:
            raise ClosedError("the KV event publisher is closed")
        if events:
            self._queue.put((events, time.time() if ts is None else ts))

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (waiting at most ``timeout_s`` seconds), stop the thread, close
        the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # it closes the sockets when it finishes
            _LOG.warning("KV event publisher still sending after %.1f s", timeout_s)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        """Send queued batches in order and answer replay requests, until the close sentinel;
        the sockets are used (and closed) by this thread only."""
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if item is None:
                    return
                self._send(*item)
        finally:
            self._close_sockets()

    def _send(self, events: Sequence[KVEvent], ts: float) -> None:
        try:
            batch = self._format.batch(events, ts=ts, data_parallel_rank=self._rank)
            payload = encode_batch(batch)
            seq = self.num_published.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq, payload))
        except Exception:  # one bad batch must not stop the stream
            _LOG.exception("KV event batch %d not published", self.num_published)
            return
        self._buffer.append((self.num_published, payload))
        self.num_published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            _LOG.warning("ignored a malformed KV event replay request (%d frames)", len(frames))
            return
        client, empty, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, empty, self._topic, seq.to_bytes(8, "big"),
                                             payload))  # fmt: skip
        self._replay.send_multipart((client, empty, b"", END_OF_REPLAY, b""))
