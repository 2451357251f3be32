"""Rank processes for the multi-rank tests: each builds its own KV tensors and worker.

``make_rank`` is the ``RankGroup`` factory (imported by the spawned rank processes; this
directory is on their ``sys.path``). ``spec`` is a plain dict:

- ``num_gpu_blocks``, ``num_cpu_blocks``, ``seed``;
- ``layout``: ``"heads"`` (each rank its own slice of the heads: its own random bytes) or
  ``"replicated"`` (every rank the same bytes; the CPU tier is the shared file ``shm``);
- ``heads``: heads per rank (``"heads"``); ``bad_rank``: that rank gets one more head;
- ``fault``: ``{"rank": r, "kind": "fail" | "slow" | "die", "delay_s": s}``: rank ``r``'s
  engine fails every batch it is given / sleeps before each submit / exits mid-job;
  ``"gate"``: each submit waits (at most ``delay_s``) for the file ``path`` to exist, and
  creates ``path + ".gave_up"`` when it stopped waiting (a rank stuck until the test lets go);
  ``faults``: a list of those, for several ranks.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from kvmgr.errors import TransferError
from kvmgr.testing import ScriptedEngine
from kvmgr.transfer.engine import TransferEngine
from kvmgr.transfer.host import HostEngine
from kvmgr.worker import TransferWorker, shared_host_pool

HEAD_BYTES = 24  #: bytes of one head of one token row
ROWS = 4  #: token rows per block


def rank_kv(spec: dict[str, Any], rank: int) -> list[torch.Tensor]:
    """The KV tensors rank ``rank`` starts with (K and V: ``[blocks, rows, heads, bytes]``)."""
    heads = spec.get("heads", 2) + (1 if spec.get("bad_rank") == rank else 0)
    replicated = spec.get("layout", "heads") == "replicated"
    gen = torch.Generator().manual_seed(spec["seed"] * 1000 + (0 if replicated else rank))
    shape = (spec["num_gpu_blocks"], ROWS, heads, HEAD_BYTES)
    return [torch.randint(1, 256, shape, dtype=torch.uint8, generator=gen) for _ in range(2)]


def _faulty_host(kind: str, delay_s: float, from_batch: int = 0, path: str = "") -> ScriptedEngine:
    """The host engine under the testing kit's scripted engine, doing ``kind`` at each submit
    from batch ``from_batch`` on: ``"fail"`` raise ``TransferError``, ``"die"`` end the
    process, ``"slow"`` sleep first."""

    def on_submit(batch_id: int, plan: Any) -> None:
        if batch_id < from_batch:
            return
        if kind == "fail":
            raise TransferError("injected: this rank's engine refuses the batch")
        if kind == "die":
            os._exit(3)  # the process dies in the middle of a job
        if kind == "gate":
            end = time.monotonic() + delay_s
            while not os.path.exists(path):
                if time.monotonic() > end:
                    open(path + ".gave_up", "w").close()
                    return
                time.sleep(0.01)
            return
        time.sleep(delay_s)

    return ScriptedEngine(HostEngine(), on_submit=on_submit)


def make_rank(rank: int, num_ranks: int, spec: dict[str, Any]) -> TransferWorker:
    """One rank's worker (see the module docstring)."""
    faults = spec.get("faults") or [spec.get("fault") or {}]  # one fault, or one per rank
    fault = next((f for f in faults if f.get("rank") == rank), {})
    if fault.get("rank") == rank and fault["kind"] == "raise":
        raise ValueError("injected: this rank's make_worker raises")
    kv = rank_kv(spec, rank)
    if fault.get("rank") == rank:
        engine: TransferEngine = _faulty_host(
            fault["kind"],
            fault.get("delay_s", 0.0),
            fault.get("from_batch", 0),
            fault.get("path", ""),
        )
    else:
        engine = HostEngine()
    layout = spec.get("layout", "heads")
    pool = None
    if layout == "replicated":
        pages = [t[0].numel() * t.element_size() for t in kv]
        pool = shared_host_pool(spec["shm"], pages, spec["num_cpu_blocks"])
    return TransferWorker(
        kv,
        spec["num_cpu_blocks"],
        engine,
        layout=layout,
        rank=rank,
        num_ranks=num_ranks,
        cpu_pool=pool,
    )
