"""The ceiling of ``kvmgr bench tiers`` for the shared tier: a zero-copy floor client.

Offers (to ``kvmgr.bench.tiers``):
    FloorClient   one socket to one server, used from one worker thread: ``mset`` writes one
                  ``MSET`` with ``socket.sendmsg`` straight from the blocks' pages, ``mget``
                  reads one ``MGET`` reply with ``recvmsg_into`` straight into them; both hash
                  every payload with XXH3-128 (the put's checksum, the get's verification), as
                  the tier does

It is deliberately the least work that moves the same bytes between the server and the CPU
tier's pages: no pool, no deadline, no retry, no redirection, no per-key command, no header
beyond a checksum, nothing read ahead (each reply's length line is received exactly). It is
written apart from ``kvmgr.tiers._resp`` (it shares no code with the client it measures).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

__all__ = ["FloorClient"]

_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX"))
_HEADER = 16  # a checksum per blob, stored in front of its pages


class FloorClient:
    """Zero-copy ``MSET``/``MGET`` of blobs ``checksum (16 B) + pages`` (see the module
    docstring). Blocking; one thread at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def mset(self, keys: Sequence[bytes], pages: Sequence[Sequence[Any]], sums: np.ndarray) -> None:
        """One ``MSET`` of blob ``i`` = ``sums[i]`` (its XXH3-128, computed here) + ``pages[i]``.

        Args:
            keys: ``n`` keys.
            pages: ``n`` lists of contiguous uint8 page views (the CPU tier's pages, not copied).
            sums: uint8 ``[n, 16]``, written with each blob's checksum.
        """
        out: list[Any] = [b"*%d\r\n$4\r\nMSET\r\n" % (2 * len(keys) + 1)]
        for i, (key, block) in enumerate(zip(keys, pages)):
            h = xxhash.xxh3_128()
            for page in block:
                h.update(page)
            sums[i] = np.frombuffer(h.digest(), dtype=np.uint8)
            size = _HEADER + sum(p.nbytes for p in block)
            out += [b"$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size), sums[i], *block, b"\r\n"]
        self._send(out)
        if self._exact(5) != b"+OK\r\n":
            raise RuntimeError("MSET refused")

    def mget(self, keys: Sequence[bytes], pages: Sequence[Sequence[Any]], sums: np.ndarray) -> int:
        """One ``MGET``; value ``i`` received into ``sums[i]`` + ``pages[i]`` and verified.
        Returns how many values were present and intact."""
        out = [b"*%d\r\n$4\r\nMGET\r\n" % (len(keys) + 1)]
        out += [b"$%d\r\n%s\r\n" % (len(key), key) for key in keys]
        self._send([b"".join(out)])
        self._exact(len(b"*%d\r\n" % len(keys)))
        good = 0
        crlf = bytearray(2)
        for i, block in enumerate(pages):
            size = _HEADER + sum(p.nbytes for p in block)
            line = b"$%d\r\n" % size
            got = self._exact(5)
            if got == b"$-1\r\n":
                continue
            got += self._exact(len(line) - 5)
            if got != line:
                raise RuntimeError("MGET: a value of another size")
            self._recv_into([sums[i], *block, crlf])
            h = xxhash.xxh3_128()
            for page in block:
                h.update(page)
            good += h.digest() == sums[i].tobytes()
        return good

    def flush(self) -> None:
        """``FLUSHALL``."""
        self._send([b"*1\r\n$8\r\nFLUSHALL\r\n"])
        self._exact(5)

    def _send(self, buffers: list[Any]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        i = 0
        while i < len(views):
            sent = self.sock.sendmsg(views[i : i + _IOV_MAX])
            while i < len(views) and sent >= views[i].nbytes:
                sent -= views[i].nbytes
                i += 1
            if sent:
                views[i] = views[i][sent:]

    def _recv_into(self, buffers: list[Any]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        i = 0
        while i < len(views):
            got = self.sock.recvmsg_into(views[i : i + _IOV_MAX])[0]
            if not got:
                raise ConnectionResetError("the server closed the connection")
            while i < len(views) and got >= views[i].nbytes:
                got -= views[i].nbytes
                i += 1
            if got:
                views[i] = views[i][got:]

    def _exact(self, num_bytes: int) -> bytes:
        buf = bytearray(num_bytes)
        self._recv_into([buf])
        return bytes(buf)
