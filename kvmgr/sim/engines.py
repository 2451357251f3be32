"""Which engine a simulated run copies with: the pages' device, ``auto`` resolved, and the
fault-injecting wrapper of ``SimConfig.fail_rate``.

Offers:
    device_and_engine   the pages' device and the engine's name for a run
    failing_stores      the engine that fails a fraction of the stores, when asked for
"""

from __future__ import annotations

import torch

from kvmgr.config import ManagerConfig
from kvmgr.sim.config import SimConfig
from kvmgr.transfer.engine import TransferEngine

__all__ = ["device_and_engine", "failing_stores"]


def device_and_engine(config: SimConfig, engine: TransferEngine | None) -> tuple[str, str]:
    """The pages' device and the engine's name (``auto`` is ``host`` without CUDA)."""
    device = "cpu" if config.engine == "host" or not _has_cuda() or _is_host(engine) else "cuda"
    return device, "host" if config.engine == "auto" and device == "cpu" else config.engine


def failing_stores(
    config: SimConfig,
    engine_name: str,
    device: str,
    manager_config: ManagerConfig,
    *,
    given: TransferEngine | None,
) -> TransferEngine | None:
    """With ``config.fail_rate`` and no ``given`` engine: the run's engine wrapped to fail that
    fraction of the stores (never loads). Otherwise ``given`` (``None``: the manager makes one).
    """
    if given is not None or config.fail_rate <= 0:
        return given
    from kvmgr.testing import FaultyEngine
    from kvmgr.transfer import Direction, make_engine

    return FaultyEngine(
        make_engine(engine_name, torch.device(device), manager_config),
        fail_rate=config.fail_rate,
        seed=config.seed,
        fail_directions=(Direction.D2H,),
    )


def _is_host(engine: TransferEngine | None) -> bool:
    """Whether a given engine copies between CPU tensors (looking through wrappers)."""
    from kvmgr.transfer import HostEngine

    while engine is not None and not isinstance(engine, HostEngine):
        engine = getattr(engine, "inner", None)
    return engine is not None


def _has_cuda() -> bool:
    return bool(torch.cuda.is_available())
