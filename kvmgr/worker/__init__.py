"""The per-rank side of kvmgr: KV tensors, CPU-tier memory, engines (torch here, not above).

Offers:
    TransferWorker   one rank's data path: a ``TransferJob`` -> its pointer plan -> its engine
    Submitted        what one rank submitted for a job (engine handle, plan counts)
    shared_host_pool  a CPU tier mapped by every rank of a group (the replicated layout)
"""

from __future__ import annotations

from kvmgr.worker.shared import shared_host_pool
from kvmgr.worker.worker import Submitted, TransferWorker

__all__ = ["Submitted", "TransferWorker", "shared_host_pool"]
