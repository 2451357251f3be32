"""Page contents of the simulation: fingerprints written into GPU pages and checked after loads.

Offers:
    PageStore   owns the simulated GPU KV tensors; writes, poisons and verifies fingerprints

Every page of a block carries a fingerprint of the block's key: the key's two int64 words,
XOR-ed with a per-tensor salt, in the first two words of the page, and the same words swapped
in the last two. Loads are checked against the key they were asked for, so a page copied to
the wrong place, not copied at all (the destination is poisoned before each load), copied
from a stale CPU block or torn at either end is caught.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvmgr.errors import GeometryError
from kvmgr.sim.keys import KEY_BYTES

__all__ = ["PageStore"]


class PageStore:
    """The GPU-tier KV tensors of a simulation and their fingerprints.

    Args:
        num_blocks: GPU blocks.
        page_bytes: bytes of one page of each tensor; multiples of 8, at least 32.
        device: where the tensors live (``cpu`` for the host engine, ``cuda`` otherwise).
        seed: seeds the per-tensor salts and the poison pattern (``numpy.random.Generator``).

    Attributes:
        tensors: ``uint8 [num_blocks, page_bytes[t]]`` per tensor, handed to the manager.

    Raises:
        GeometryError: a page size that is not a multiple of 8 or is below 32 bytes.
    """

    def __init__(
        self,
        num_blocks: int,
        page_bytes: Sequence[int],
        device: torch.device | str = "cpu",
        *,
        seed: int = 0,
    ) -> None:
        for t, size in enumerate(page_bytes):
            if size % 8 or size < 32:
                raise GeometryError(
                    f"tensor {t}: expected page bytes a multiple of 8 and >= 32, got {size}"
                )
        self.device = torch.device(device)
        self.tensors = [
            torch.empty(num_blocks, size, dtype=torch.uint8, device=self.device)
            for size in page_bytes
        ]
        self._on_cpu = self.device.type == "cpu"
        # int64 [num_blocks, page_bytes // 8] views: numpy on the CPU (cheap indexing), else torch
        self._words = [t.view(torch.int64) for t in self.tensors]
        self._np_words = [w.numpy() for w in self._words] if self._on_cpu else []
        rng = np.random.default_rng(seed)
        info = np.iinfo(np.int64)
        self._salts = list(rng.integers(info.min, info.max, size=len(self.tensors), dtype=np.int64))
        self._poison = rng.integers(info.min, info.max, dtype=np.int64)
        self.num_pages_written = 0

    @property
    def num_tensors(self) -> int:
        """KV tensors."""
        return len(self.tensors)

    def write(self, block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """Fill the pages of ``block_ids[i]`` with the fingerprint of ``keys[i]`` (all tensors)."""
        if not block_ids:
            return
        head = _fingerprints(keys)
        ids = np.asarray(block_ids, dtype=np.int64)
        for t, salt in enumerate(self._salts):
            self._store(t, ids, head ^ salt)
        self.num_pages_written += len(ids) * len(self._salts)

    def poison(self, block_ids: Sequence[int]) -> None:
        """Overwrite the fingerprint words of the blocks' pages with a poison pattern."""
        if not block_ids:
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        poison = np.full((len(ids), 2), self._poison, dtype=np.int64)
        for t in range(len(self._salts)):
            self._store(t, ids, poison)

    def verify(self, block_ids: Sequence[int], keys: Sequence[bytes]) -> int:
        """Number of pages of ``block_ids[i]`` whose fingerprint is not that of ``keys[i]``."""
        if not block_ids:
            return 0
        head = _fingerprints(keys)
        ids = np.asarray(block_ids, dtype=np.int64)
        bad = np.zeros(len(ids), dtype=np.int64)
        for t, salt in enumerate(self._salts):
            expected = head ^ salt
            got_head, got_tail = self._load(t, ids)
            bad += np.any(got_head != expected, axis=1) | np.any(
                got_tail != expected[:, ::-1], axis=1
            )
        return int(bad.sum())

    def _store(self, t: int, ids: np.ndarray, head: np.ndarray) -> None:
        tail = head[:, ::-1]
        if self._on_cpu:
            self._np_words[t][ids, :2] = head
            self._np_words[t][ids, -2:] = tail
            return
        words, index = self._words[t], torch.from_numpy(ids).to(self.device)
        words[index, :2] = torch.from_numpy(np.ascontiguousarray(head)).to(self.device)
        words[index, -2:] = torch.from_numpy(np.ascontiguousarray(tail)).to(self.device)

    def _load(self, t: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._on_cpu:
            return self._np_words[t][ids, :2], self._np_words[t][ids, -2:]
        rows = self._words[t][torch.from_numpy(ids).to(self.device)]
        return rows[:, :2].cpu().numpy(), rows[:, -2:].cpu().numpy()


def _fingerprints(keys: Sequence[bytes]) -> np.ndarray:
    """int64 ``[len(keys), 2]``: the words of each key."""
    return np.frombuffer(b"".join(keys), dtype=np.int64).reshape(len(keys), KEY_BYTES // 8)
