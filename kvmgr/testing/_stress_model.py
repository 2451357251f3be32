"""The model of the randomized stress: its keys, its requests, and what every page must hold.

Private to ``kvmgr.testing``. Key id ``k`` (``key_of(k)``) names pages ``content[t][k]`` in
every tensor ``t``; ``check_cpu_pages`` and ``check_gpu_pages`` compare the manager's pages
with them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvmgr.config import ManagerConfig
from kvmgr.pool.block_table import Tier

__all__ = [
    "FAMILIES",
    "MAX_LEN",
    "NUM_KEYS",
    "PAGES",
    "ModelRequest",
    "StressFailure",
    "check_cpu_pages",
    "check_gpu_pages",
    "key_of",
    "misuses",
    "random_config",
    "random_prompt",
    "settle_moves",
]

#: prefix families x blocks per prompt: keys ``f * MAX_LEN + j``
FAMILIES, MAX_LEN = 12, 8
NUM_KEYS = FAMILIES * MAX_LEN
PAGES = (24, 20)  # bytes of one page of the uint8 and of the int32 tensor


class StressFailure(AssertionError):
    """The stress found wrong bytes, a broken invariant or an untyped error; the message names
    the seed, the operation count and the last operations."""


def key_of(k: int) -> bytes:
    """The manager's key of key id ``k`` (``content[t][k]`` is what its pages hold)."""
    return b"stress" + k.to_bytes(4, "little")


class ModelRequest:
    """A request of the model: its prompt (key ids) and, per logical block, what is known."""

    __slots__ = ("blocks", "kind", "loading", "prompt", "state", "valid")

    def __init__(self, prompt: list[int], blocks: list[int]) -> None:
        self.prompt, self.blocks = prompt, blocks
        self.valid = [False] * len(blocks)  # holds content[prompt[j]]
        self.loading: set[int] = set()
        self.state = "gpu"  # "gpu" | "moving" | "cpu"
        self.kind = ""  # "preempt" | "resume" while moving

    def loaded(self, blocks: tuple[int, ...], *, ok: bool) -> None:
        """A load of logical ``blocks`` ended: they hold their keys' pages when it succeeded."""
        self.loading.difference_update(blocks)
        if ok:
            for j in blocks:
                self.valid[j] = True


def check_cpu_pages(
    snapshot: Any, cpu_tensors: Sequence[torch.Tensor], content: list[torch.Tensor]
) -> int:
    """Compare every READY key's CPU pages with what its key names; the pages checked.

    Args:
        snapshot: the manager's ``snapshot()``.
        cpu_tensors: the CPU tier's tensors, uint8 ``[num_cpu_blocks, page_bytes]`` each.
        content: per tensor, uint8 ``[NUM_KEYS, page_bytes]``.

    Raises:
        StressFailure: a READY key's CPU block holds other bytes.
    """
    ready = [(k, e.cpu_block_id) for k, e in snapshot.keys.items() if e.state.name == "READY"]
    if not ready:
        return 0
    ids = torch.tensor([int.from_bytes(k[6:], "little") for k, _ in ready])
    blocks = torch.tensor([b for _, b in ready])
    for pages, want in zip(cpu_tensors, content):
        bad = (pages[blocks] != want[ids]).any(dim=1)
        if bad.any():
            key = ready[int(bad.nonzero()[0])][0]
            raise StressFailure(f"CPU tier serves wrong bytes for key {key!r}")
    return len(ready) * len(content)


def check_gpu_pages(
    reqs: dict[int, ModelRequest], rows: Sequence[torch.Tensor], content: list[torch.Tensor]
) -> int:
    """Compare every known GPU page of every request on the GPU with its key; the pages checked.

    Args:
        reqs: the model's requests by id.
        rows: the GPU KV tensors as uint8 ``[num_gpu_blocks, page_bytes]``.
        content: per tensor, uint8 ``[NUM_KEYS, page_bytes]``.

    Raises:
        StressFailure: a block the model knows holds other bytes.
    """
    checked = 0
    for rid, req in reqs.items():
        if req.state != "gpu":
            continue
        known = [j for j, ok in enumerate(req.valid) if ok and j not in req.loading]
        if not known:
            continue
        blocks = torch.tensor([req.blocks[j] for j in known])
        ids = torch.tensor([req.prompt[j] for j in known])
        for pages, want in zip(rows, content):
            if (pages[blocks] != want[ids]).any():
                raise StressFailure(f"request {rid}: a GPU block holds wrong bytes")
        checked += len(known) * len(content)
    return checked


def random_prompt(rng: Any) -> list[int]:
    """A prompt of 1 to ``MAX_LEN`` key ids: a prefix of one of the ``FAMILIES``."""
    family, length = rng.randrange(FAMILIES), rng.randint(1, MAX_LEN)
    return [family * MAX_LEN + j for j in range(length)]


def random_config(rng: Any) -> ManagerConfig:
    """A manager configuration drawn from ``rng`` (a ``random.Random``): tier size, policy,
    flush, backpressure, store wait, merging; always the host engine."""
    return ManagerConfig(
        num_cpu_blocks=rng.choice((4, 8, 16, 24)),
        engine="host",
        policy=rng.choice(("lru", "arc", "s3fifo", "reuse")),
        flush=rng.choice(("step", "step", "tick")),
        backpressure=rng.choice(("fail", "wait")),
        store_wait_s=rng.choice((0.5, 5.0)),
        merge=rng.random() < 0.8,
    )


def settle_moves(reqs: dict[int, ModelRequest], mgr: Any) -> None:
    """Requests whose preempt or resume ended (or was cancelled and ended since) take the state
    the manager's block table shows: on the GPU (with its new blocks) or on the CPU."""
    for rid, req in reqs.items():
        if req.state != "moving" or mgr.is_moving(rid):
            continue
        table = mgr.block_table(rid)
        on_gpu = bool(table) and table[0][0] is Tier.GPU
        if not table:
            on_gpu = req.kind == "preempt"  # an empty table: unchanged
        req.state = "gpu" if on_gpu else "cpu"
        if on_gpu:
            req.blocks = [b for _, b in table]


def misuses(mgr: Any, held: list[int], key: bytes) -> list[Callable[[], Any]]:
    """Calls the manager must refuse with a typed error, changing nothing (``held``: GPU blocks
    of requests on the GPU; ``key``: any key of the model)."""
    return [
        lambda: mgr.allocate(-1, -1),
        lambda: mgr.swap_in([b"never-stored"], held[:1] or [0]),
        lambda: mgr.store_many(
            held[:2], [b"cycle-a", b"cycle-b"], parents=[b"cycle-b", b"cycle-a"]
        ),
        lambda: mgr.swap_out([10**6], [key]),
        lambda: mgr.resume("no-such-request"),
    ]
