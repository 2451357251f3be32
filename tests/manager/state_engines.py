"""The engines the manager state machine (``test_state_machine``) runs over, each under the
testing kit's ``ScriptedEngine(..., hold=True)`` so that every batch runs only when a rule says.

- ``null``: the no-copy engine (``NullEngine``): bookkeeping only, no byte is checked;
- ``null-faults`` / ``host-faults``: the scripted engine's fault modes (seeded failures, refused
  submits, real-time delays), drawn per example;
- ``host``: the host engine (real copies between CPU tensors);
- ``cuda-fake`` / ``kernel-fake`` / ``auto-fake``: the batched-DMA, copy-kernel and per-batch
  choice engines on ``cuda_fakes`` (a driver that memmoves, the copy kernel under the Triton
  interpreter), CPU tensors;
- ``cuda`` / ``kernel`` / ``auto``: the real engines on CUDA tensors (``gpu``-marked).
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from cuda_fakes import FakeCuda, FakeDriver, FakeDriverLib, KernelFakeCuda

from kvmgr import ManagerConfig
from kvmgr.testing import NullEngine, ScriptedEngine
from kvmgr.transfer import ENGINES, HostEngine, make_engine, pinned
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.engine import TransferEngine
from kvmgr.transfer.pinned import HostRegistrar


@attrs.frozen
class EngineSpec:
    """One engine of the state machine.

    Attributes:
        name: the test id.
        copies: whether bytes really move (the no-copy engine's pages are never checked).
        faults: whether the scripted engine draws failures, refusals and delays per example.
        fake: ``"cuda"`` or ``"kernel"``: the ``cuda_fakes`` to install; ``None``: none.
        device: where the KV tensors live.
    """

    name: str
    copies: bool = True
    faults: bool = False
    fake: str | None = None
    device: str = "cpu"

    @property
    def kind(self) -> str:
        """The engine under the scripted one: ``null``, ``host``, ``cuda``, ``kernel``, ``auto``."""
        return self.name.split("-")[0]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda | None:
        """Put this engine's fake CUDA in place (undone with ``monkeypatch``)."""
        if self.fake is None:
            return None
        fake = KernelFakeCuda() if self.fake == "kernel" else FakeCuda()
        # the CPU tier "page-locked" by a registrar that accepts every range: pageable memory
        # would send the kernel engines' copies to the DMA path only
        registrar = HostRegistrar(lambda address, num_bytes: None, lambda address: None)
        monkeypatch.setattr(pinned, "torch_registrar", lambda: registrar)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)  # pinning threads
        return fake.install(monkeypatch)

    def build(self, fake: FakeCuda | None, config: ManagerConfig, script: dict[str, Any]):  # type: ignore[no-untyped-def]
        """The scripted engine (holding every batch) over a new inner engine; ``script``: the
        drawn fault arguments (``ScriptedEngine``'s keywords)."""
        if self.kind == "null":
            return NullEngine(hold=True, **script)
        return ScriptedEngine(self._inner(fake, config), hold=True, **script)

    def _inner(self, fake: FakeCuda | None, config: ManagerConfig) -> TransferEngine:
        if self.kind == "host":
            return HostEngine()
        if fake is None:  # a real GPU
            return make_engine(self.kind, torch.device(self.device), config)
        from kvmgr.transfer.cuda_engine import AutoEngine, CopyKernelEngine, CudaBatchEngine

        if self.kind == "cuda":
            lib = FakeDriverLib()
            driver = CopyDriver(lib.resolver(), driver_version=13000)
            driver.fake_lib = lib  # type: ignore[attr-defined]  # its callbacks must live
            lib.calls = fake.log  # driver calls logged with the streams' and events'
            return CudaBatchEngine(driver=driver)
        cls = CopyKernelEngine if self.kind == "kernel" else AutoEngine
        return cls(driver=FakeDriver(fake.log), warmup=False)


GPU = pytest.mark.gpu
SPECS = [
    EngineSpec("null", copies=False),
    EngineSpec("null-faults", copies=False, faults=True),
    EngineSpec("host"),
    EngineSpec("host-faults", faults=True),
    EngineSpec("cuda-fake", fake="cuda"),
    EngineSpec("kernel-fake", fake="kernel"),
    EngineSpec("auto-fake", fake="kernel"),
    EngineSpec("cuda", device="cuda"),
    EngineSpec("kernel", device="cuda"),
    EngineSpec("auto", device="cuda"),
]
PARAMS = [pytest.param(s, id=s.name, marks=[GPU] if s.device == "cuda" else []) for s in SPECS]
assert {s.kind for s in SPECS} == {"null", *ENGINES}, "a new engine: add it to SPECS"
