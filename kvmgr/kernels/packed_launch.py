"""Launches of a compiled Triton kernel straight through the CUDA driver, from packed arguments.

Offers:
    PackedLaunch      one kernel's arguments packed once into a ctypes buffer (``void *[n]``
                      pointing at each argument's storage); ``set_tensor`` / ``set_int`` update
                      an argument in place, ``launch(grid)`` calls ``cuLaunchKernel``
    TritonLaunch      the same interface over :class:`kvmgr.kernels.launch.DirectLauncher`'s
                      call: the fallback (interpreter, no driver, unsupported kernels)
    pack              a :class:`PackedLaunch` for a ``CompiledKernel`` and its arguments, or None
    param_ctypes      the C type of each kernel parameter, from the compiled signature
    ptx_param_sizes   the byte sizes of the ``.entry`` parameters in a PTX listing

Why: a Triton launch, even past ``JITFunction.run`` (:mod:`kvmgr.kernels.launch`), still goes
through the compiled launcher's Python argument parsing: 10-20 us per launch on the H200 host.
Here a step updates a few ctypes cells (its pointers, ``T``, the grid) and makes one ctypes call.

**What is packed.** For each parameter of the ``@triton.jit`` function, in order: nothing for a
constexpr (including ints equal to 1 and ``None``, which Triton turns into constants; the
compiled signature says which), else one ctypes cell of the signature's type (``*T`` -> u64
address, ``i32`` -> int32, ``fp32`` -> float, ...). Triton 3.5+ appends two hidden pointers to
every kernel, a global and a profile scratch buffer (one, the global, before 3.5): they are
passed NULL, and a kernel that needs either (``global_scratch_size`` or
``profile_scratch_size`` > 0) is not packed. The layout is checked once against the kernel's
PTX ``.entry`` parameters (sizes, then one or two 8-byte hidden pointers); any
difference, an unknown type, ``num_ctas != 1``, PDL or cooperative launches, and a missing
``libcuda`` give None, and the caller keeps the :class:`TritonLaunch`.

**Launch.** ``cuLaunchKernel(function, grid, (32 * num_warps, 1, 1), shared, stream, params,
NULL)``: what Triton's launcher issues for these kernels (``cuLaunchKernelEx`` with no
attributes). The stream is the given one, or the current stream of the bound device, so a launch
under CUDA-graph capture is captured. The driver copies the parameters at the call, so updating
the cells afterwards never changes an enqueued or captured launch.

**Fallback per call.** A launch takes the normal path (the kept Python arguments through the
:class:`~kvmgr.kernels.launch.DirectLauncher`) when a Triton launch hook is set (profilers), the
current device is not the bound one, or the calling thread's current CUDA context is not the one
the kernel was loaded in.

**Contract.** ``set_tensor`` / ``set_int`` may change a value only within the specialization the
kernel was compiled for (the caller keys its packed launches on that: alignment of specialized
pointers, ``== 1`` and ``% 16`` of specialized ints, dtypes, constexprs); ``set_int`` raises
``OverflowError`` for a value that does not fit its cell. One packed launch is not thread-safe.
"""

from __future__ import annotations

import ctypes
import functools
import re
import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PackedLaunch", "TritonLaunch", "pack", "param_ctypes", "ptx_param_sizes"]

_CTYPES: dict[str, Any] = {
    "i1": ctypes.c_int8, "i8": ctypes.c_int8, "u1": ctypes.c_uint8, "u8": ctypes.c_uint8,
    "i16": ctypes.c_int16, "u16": ctypes.c_uint16, "i32": ctypes.c_int32, "u32": ctypes.c_uint32,
    "i64": ctypes.c_int64, "u64": ctypes.c_uint64, "fp32": ctypes.c_float, "f32": ctypes.c_float,
    "fp64": ctypes.c_double,
}  # fmt: skip
_NUM_HIDDEN = (1, 2)  # hidden pointers Triton appends: global scratch (+ profile scratch, 3.5+)
_PTX_ENTRY = re.compile(r"\.entry\s+[\w$]+\s*\(([^)]*)\)")
_PTX_PARAM = re.compile(r"\.param\s+\.[a-z]+?(\d+)\b")


class TritonLaunch:
    """A reusable launch through :class:`~kvmgr.kernels.launch.DirectLauncher` (the fallback).

    Same interface as :class:`PackedLaunch`; ``args`` holds the Python arguments.
    """

    is_packed = False

    def __init__(self, launcher: Any, args: Sequence[Any], options: dict[str, int]) -> None:
        self.args = list(args)
        self._launcher = launcher
        self._options = options

    def set_tensor(self, index: int, t: torch.Tensor) -> None:
        """Argument ``index`` (in the kernel's parameter order) becomes ``t``."""
        self.args[index] = t

    def set_int(self, index: int, value: int) -> None:
        """Argument ``index`` becomes ``value``."""
        self.args[index] = value

    def set_tensor_at(self, index: int, t: torch.Tensor, address: int) -> None:
        """:meth:`set_tensor` with ``t.data_ptr()`` already read by the caller (``address``)."""
        self.args[index] = t

    def launch(self, grid: tuple[int, int, int], stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue on ``stream`` (a torch stream), or the current stream when None."""
        if stream is None:
            self._launcher(grid, *self.args, **self._options)
        else:
            with torch.cuda.stream(stream):
                self._launcher(grid, *self.args, **self._options)


class PackedLaunch(TritonLaunch):
    """One compiled kernel's arguments in a ctypes buffer, launched with ``cuLaunchKernel``.

    Built by :func:`pack`. Attributes: ``args`` (the Python arguments, kept for the per-call
    fallback), ``params`` (the ``void *`` array handed to the driver), ``device`` (the device
    index the kernel was loaded on).
    """

    is_packed = True

    def __init__(
        self, launcher: Any, args: Sequence[Any], options: dict[str, int], types: Sequence[str | None],
        num_hidden: int, function: int, num_warps: int, shared: int, device: int, driver: _Driver, knobs: Any,
    ) -> None:  # fmt: skip
        super().__init__(launcher, args, options)
        self.device = device
        self._cells: list[Any] = []
        keep: list[Any] = []
        for ty, value in zip(types, args, strict=True):
            cell = None
            if ty is not None:
                cell = ctypes.c_uint64(_address(value)) if ty[0] == "*" else _CTYPES[ty](value)
                keep.append(cell)
            self._cells.append(cell)
        keep += [ctypes.c_uint64(0) for _ in range(num_hidden)]  # NULL scratch pointers
        self._keep = keep
        self.params = (ctypes.c_void_p * len(keep))(*(ctypes.addressof(c) for c in keep))
        self._grid = (ctypes.c_uint(1), ctypes.c_uint(1), ctypes.c_uint(1))
        self._stream = ctypes.c_void_p(0)
        self._call = (ctypes.c_void_p(function), *self._grid, ctypes.c_uint(32 * num_warps),
                      ctypes.c_uint(1), ctypes.c_uint(1), ctypes.c_uint(shared), self._stream,
                      self.params, None)  # fmt: skip
        self._driver = driver
        self._knobs = knobs
        self._context = driver.current_context()
        self._thread = threading.get_ident()
        self._get_device: Any = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
        self._get_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def set_tensor(self, index: int, t: torch.Tensor) -> None:
        """Pointer argument ``index`` becomes ``t.data_ptr()`` (same alignment class)."""
        self.args[index] = t
        self._cells[index].value = t.data_ptr()

    def set_tensor_at(self, index: int, t: torch.Tensor, address: int) -> None:
        """:meth:`set_tensor` with ``t.data_ptr()`` already read by the caller (``address``)."""
        self.args[index] = t
        self._cells[index].value = address

    def set_int(self, index: int, value: int) -> None:
        """Int argument ``index`` becomes ``value``; ``OverflowError`` if its cell cannot hold it."""
        self.args[index] = value
        cell = self._cells[index]
        if cell is not None:  # None: a constexpr under this specialization (equal by the key)
            cell.value = value
            if cell.value != value:
                raise OverflowError(f"argument {index}: {value} does not fit {type(cell).__name__}")

    def value(self, index: int) -> Any:
        """The packed value of argument ``index`` (an int or float; None for a constexpr)."""
        cell = self._cells[index]
        return None if cell is None else cell.value

    def launch(self, grid: tuple[int, int, int], stream: torch.cuda.Stream | None = None) -> None:
        """``cuLaunchKernel`` over ``grid`` on ``stream`` (or the bound device's current one).

        Raises:
            RuntimeError: the driver refused the launch (its error name in the message).
        """
        knobs = self._knobs
        if (
            _active(knobs.launch_enter_hook) or _active(knobs.launch_exit_hook)
            or self._get_device() != self.device
            or (threading.get_ident() != self._thread and not self._adopt_thread())
        ):  # fmt: skip
            super().launch(grid, stream)
            return
        x, y, z = self._grid
        x.value, y.value, z.value = grid
        self._stream.value = self._get_stream(self.device) if stream is None else stream.cuda_stream
        result = self._driver.launch(*self._call)
        if result:
            raise RuntimeError(f"cuLaunchKernel: {self._driver.error_name(result)}")

    def _adopt_thread(self) -> bool:
        """Whether this thread's current context is the kernel's; if so, launch from it too."""
        if self._driver.current_context() != self._context:
            return False
        self._thread = threading.get_ident()
        return True


def pack(
    launcher: Any, compiled: Any, args: Sequence[Any], options: dict[str, int], device: int, knobs: Any,
) -> PackedLaunch | None:  # fmt: skip
    """A :class:`PackedLaunch` of ``compiled`` with ``args``, or None where one cannot be made.

    ``compiled`` is the ``CompiledKernel`` that ``launcher`` (a ``DirectLauncher``) uses for
    ``args`` on ``device``. None: no ``libcuda``, or a kernel this module does not pack (module
    docstring).
    """
    driver = _driver()
    if driver is None:
        return None
    try:
        meta = compiled.metadata
        if (
            getattr(meta, "num_ctas", 1) != 1
            or getattr(meta, "launch_pdl", False)
            or getattr(meta, "launch_cooperative_grid", False)
            or getattr(meta, "global_scratch_size", 0)
            or getattr(meta, "profile_scratch_size", 0)
        ):
            return None
        types = param_ctypes(compiled.src.signature, launcher.kernel.arg_names)
        if types is None or len(types) != len(args):
            return None
        sizes = [8 if ty[0] == "*" else ctypes.sizeof(_CTYPES[ty]) for ty in types if ty]
        entry = ptx_param_sizes(compiled.asm["ptx"])
        num_hidden = -1 if entry is None else len(entry) - len(sizes)
        if entry is None or entry[: len(sizes)] != sizes or num_hidden not in _NUM_HIDDEN:
            return None
        if entry[len(sizes) :] != [8] * num_hidden:
            return None
        _ = compiled.run  # loads the module: sets compiled.function
        return PackedLaunch(launcher, args, options, types, num_hidden, compiled.function,
                            meta.num_warps, meta.shared, device, driver, knobs)  # fmt: skip
    except Exception:  # Triton internals differ from these: keep the normal launch
        return None


def param_ctypes(signature: dict[Any, str], arg_names: Sequence[str]) -> list[str | None] | None:
    """Per parameter of the kernel, its compiled type (``"*fp32"``, ``"i32"``, ...) or None.

    None marks a constexpr (not passed to the driver). Returns None for a type this module does
    not pack (tensor descriptors, tuples, fp16/bf16 scalars) or a signature of other names.
    """
    if list(signature) != list(arg_names):
        return None
    types: list[str | None] = []
    for ty in signature.values():
        if ty == "constexpr":
            types.append(None)
        elif isinstance(ty, str) and (ty[0] == "*" or ty in _CTYPES):
            types.append(ty)
        else:
            return None
    return types


def ptx_param_sizes(ptx: str) -> list[int] | None:
    """Byte sizes of the parameters of the (single) ``.entry`` in ``ptx``; None if none found."""
    entry = _PTX_ENTRY.search(ptx)
    if entry is None:
        return None
    return [int(bits) // 8 for bits in _PTX_PARAM.findall(entry.group(1))]


def _address(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    if value is None:
        return 0
    raise TypeError(f"pointer argument: expected a tensor, got {type(value).__name__}")


def _active(hook: Any) -> bool:
    return hook is not None and getattr(hook, "calls", True) != []


class _Driver:
    """The three libcuda entry points a packed launch uses (resolved once per process)."""

    def __init__(self, lib: Any) -> None:
        self.launch = lib.cuLaunchKernel
        self.launch.restype = ctypes.c_int
        self._get_context = lib.cuCtxGetCurrent
        self._error_name = lib.cuGetErrorName

    def current_context(self) -> int | None:
        ctx = ctypes.c_void_p()
        return ctx.value if self._get_context(ctypes.byref(ctx)) == 0 else None

    def error_name(self, result: int) -> str:
        name = ctypes.c_char_p()
        self._error_name(result, ctypes.byref(name))
        return f"{(name.value or b'CUDA error').decode()} ({result})"


@functools.cache
def _driver() -> _Driver | None:
    """libcuda, loaded lazily (None where it cannot be: no NVIDIA driver, the interpreter)."""
    try:
        return _Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None
