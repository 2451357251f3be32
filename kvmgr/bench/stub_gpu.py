"""A stand-in GPU for measuring and testing launch paths on a machine without one.

Offers:
    install     make this process's Triton compile for ``cuda:90`` (its real compiler, a stub
                driver), kvmgr's packed launches call a stub ``cuLaunchKernelEx``, and the
                kernels take CPU tensors as device memory; returns the :class:`StubGpu`
    StubGpu     what the stand-ins saw: packed launches (``calls``, with ``record=True``),
                launches through Triton's own launcher and through ``JITFunction.run``

Nothing is executed: a launch writes nothing, so this is for host paths only (what a step costs
on the host, which arguments reach the driver). The stub ``cuLaunchKernelEx`` is libm's
``fegetround`` (a C function that ignores its arguments and returns 0), called through the same
path as libcuda's (kvmgr's C call, :mod:`kvmgr.kernels.launch.native`, or ctypes where that cannot
be built), so the figures include that call but none of the driver's own time (5.6-7.1 us per launch on the H200 host, BENCHMARKS.md). With ``record=True`` it is a
Python function that records each launch's configuration and parameter cells instead (tests).

Once installed, the process stays so: run it in a process of its own (``kvmgr bench
launch-host``, or a test's subprocess). Never on a machine whose GPU the process also uses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import struct
from typing import Any

import attrs
import torch

__all__ = ["StubGpu", "install"]

_STREAM = 7  # the current stream's handle, as the stubs report it


@attrs.define
class StubGpu:
    """What the stand-ins saw.

    Attributes:
        calls: with ``record=True``, one dict per packed launch: ``grid``, ``block``,
            ``stream``, ``attrs`` (pointer, count), ``function``, ``extra`` and ``params`` (each
            cell's 8 bytes at the time of the call).
        triton_launches: launches through Triton's compiled launcher (argument counts).
        jit_launches: launches through ``JITFunction.run`` (kernel names; warmups excluded).
    """

    calls: list[dict[str, Any]] = attrs.field(factory=list)
    triton_launches: list[int] = attrs.field(factory=list)
    jit_launches: list[str] = attrs.field(factory=list)


def install(*, record: bool = False) -> StubGpu:
    """Install the stand-ins in this process (module docstring); returns what they will see."""
    import triton.runtime.jit as jit
    from triton.runtime.driver import driver

    from kvmgr.kernels.launch import launcher
    from kvmgr.kernels.mla import plan

    seen = StubGpu()
    driver.set_active(_triton_driver(seen))
    run = jit.JITFunction.run

    def counting_run(self: Any, *args: Any, grid: Any, warmup: bool, **kw: Any) -> Any:
        if not warmup:
            seen.jit_launches.append(self.fn.__name__)
        return run(self, *args, grid=grid, warmup=warmup, **kw)

    jit.JITFunction.run = counting_run  # type: ignore[method-assign]
    libcuda = _Libcuda(seen if record else None)
    launcher.driver = lambda: libcuda  # type: ignore[assignment]
    torch._C._cuda_getDevice = (0).__index__  # type: ignore[attr-defined]  # C-level, as the real
    torch._C._cuda_getCurrentRawStream = {0: _STREAM}.get  # type: ignore[attr-defined]
    plan.IS_INTERPRETED = True  # the kernels' checks take CPU tensors for device memory
    return seen


class _Libcuda:
    """libcuda's three entry points as a packed launch calls them."""

    def __init__(self, seen: StubGpu | None) -> None:
        if seen is None:
            libm = ctypes.CDLL(ctypes.util.find_library("m"))
            self.launch = libm.fegetround  # returns 0 (round to nearest); ignores the arguments
            self.launch.restype = ctypes.c_int
            self.launch_address = ctypes.cast(self.launch, ctypes.c_void_p).value
        else:  # a Python function: packed launches take the ctypes path to it
            self.launch = lambda *args: _record(seen, *args)
            self.launch_address = None

    def current_context(self) -> int:
        return 1

    def error_name(self, result: int) -> str:
        return f"CUDA error {result}"


def _record(seen: StubGpu, config: Any, function: Any, params: Any, extra: Any) -> int:
    head = struct.unpack("<7I4xQQI4x", ctypes.string_at(config.value, 56))
    seen.calls.append({
        "grid": list(head[:3]), "block": list(head[3:6]), "stream": head[7],
        "attrs": list(head[8:]), "function": function.value, "extra": extra,
        "params": [ctypes.string_at(params[i], 8) for i in range(len(params))],
    })  # fmt: skip
    return 0


def _triton_driver(seen: StubGpu) -> Any:
    """Triton's active driver for a ``cuda:90`` target: real compiles, no device."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import GPUDriver

    class StubDriver(GPUDriver):  # type: ignore[misc]
        def __init__(self) -> None:
            self.get_current_device = lambda: 0
            self.get_current_stream = lambda device=0: _STREAM
            self.set_current_device = lambda device: None
            self.utils = _Utils()
            self.launcher_cls = lambda src, metadata: _Launcher(seen)

        @staticmethod
        def is_active() -> bool:
            return True

        def get_current_target(self) -> Any:
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        def get_benchmarker(self) -> Any:
            raise NotImplementedError

        def get_device_interface(self) -> Any:
            return torch.cuda

    return StubDriver()


class _Launcher:
    """Triton's C launcher, minus the driver call: records that it was called."""

    def __init__(self, seen: StubGpu) -> None:
        self._seen = seen

    def __call__(self, *args: Any) -> None:
        self._seen.triton_launches.append(len(args))


class _Utils:
    """The driver utilities a compile asks for: a loaded binary, the device's properties."""

    def load_binary(self, name: Any, kernel: Any, shared: Any, device: Any) -> tuple[int, ...]:
        return (1, 1, 32, 0, 1024)  # module, function, registers, spills, max threads

    def get_device_properties(self, device: Any) -> dict[str, int]:
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32}  # fmt: skip
