"""Bound launches: one compiled specialization with its arguments packed, launched by the driver.

Offers (to the rest of :mod:`kvmgr.kernels.launch`):
    Packing         what packing one compiled kernel takes (types, scratch pointers, handle)
    packing_of      a ``CompiledKernel``'s :class:`Packing`, or None where it cannot be packed
    PackedLaunch    the arguments in one ctypes buffer; ``run`` / ``launch`` call
                    ``cuLaunchKernelEx`` with the step's values written in one ``pack_into``
    TritonLaunch    the same interface over Triton's own launch (the fallback)
    param_ctypes, ptx_param_sizes   the compiled signature's types; a PTX ``.entry``'s sizes

Why: Triton's launch parses every argument in Python on every call (10-20 us on the H200 host,
past ``JITFunction.run``'s own dispatch). A bound launch keeps the arguments where the driver
reads them; a step writes its few changing values and calls the driver once.

**Buffer.** One ctypes buffer holds, in order: the ``CUlaunchConfig`` (grid, block
``32 * num_warps``, shared bytes, stream, no attributes: what Triton's launcher passes for these
kernels); one 8-byte cell per *varying* argument (the positions the owner changes per step; a
scratch cell where the compiled signature has none, e.g. an int equal to 1, which Triton turns
into a constant); the other arguments' cells; and the hidden scratch pointers Triton appends
(one, or two from Triton 3.5), passed NULL. A kernel that needs scratch memory
(``global_scratch_size`` or ``profile_scratch_size`` > 0), clusters, PDL or cooperative
launches is not packed, nor one whose packed layout differs from its PTX ``.entry`` parameters.
A step then costs one ``struct.pack_into`` (grid, stream and values) and one ctypes call. The
driver copies the parameters at the call, so later writes never change an enqueued or captured
launch.

**Fallback per call** (Triton's own launch, with the same Python arguments): a Triton launch hook
is set (profilers), the current device is not the bound one, or the calling thread's current CUDA
context is not the one the kernel was loaded in.

**Contract.** Values may change only within the specialization the launch was bound for (the
owner keys its bound launches on :func:`kvmgr.kernels.launch.rule.reader`'s classes); a value
that does not fit its cell raises ``OverflowError``. One bound launch is not thread-safe.
"""

from __future__ import annotations

import ctypes
import functools
import re
import struct
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = [
    "PackedLaunch", "Packing", "TritonLaunch", "driver", "packing_of", "param_ctypes",
    "ptx_param_sizes",
]  # fmt: skip

_CELL = {  # compiled type -> struct format of its 8-byte cell
    "i1": "b7x", "i8": "b7x", "u1": "B7x", "u8": "B7x", "i16": "h6x", "u16": "H6x",
    "i32": "i4x", "u32": "I4x", "i64": "q", "u64": "Q", "fp32": "f4x", "f32": "f4x", "fp64": "d",
}  # fmt: skip
_SIZE = {"b": 1, "B": 1, "h": 2, "H": 2, "i": 4, "I": 4, "q": 8, "Q": 8, "f": 4, "d": 8}
_HEADER = "<7I4xQ16x"  # CUlaunchConfig: grid, block, shared, pad, stream, attrs NULL, 0 attrs
_HEADER_BYTES = struct.calcsize(_HEADER)  # 56
_NUM_HIDDEN = (1, 2)  # hidden pointers Triton appends: global scratch (+ profile scratch, 3.5+)
_PTX_ENTRY = re.compile(r"\.entry\s+[\w$]+\s*\(([^)]*)\)")
_PTX_PARAM = re.compile(r"\.param\s+\.[a-z]+?(\d+)\b")


class Packing(NamedTuple):
    """How one compiled kernel is packed: per parameter its compiled type (None: constexpr),
    the hidden NULL pointers, the ``CUfunction`` handle, threads per block and shared bytes."""

    types: tuple[str | None, ...]
    num_hidden: int
    function: int
    block: int
    shared: int


class TritonLaunch:
    """A reusable launch through Triton's own ``kernel[grid](*args)`` (the fallback).

    Same interface as :class:`PackedLaunch`. Attributes: ``args`` (the Python arguments of the
    last launch, in parameter order).
    """

    is_packed = False

    def __init__(self, kernel: Any, args: Sequence[Any], options: dict[str, int], varying: Sequence[int]) -> None:  # fmt: skip
        self._kernel = kernel
        self._args = list(args)
        self._options = options
        self._varying = tuple(varying)
        self._changed: Sequence[Any] | None = None  # varying args not yet merged into _args

    @property
    def args(self) -> list[Any]:
        """The Python arguments of the last launch, in parameter order."""
        if self._changed is not None:
            for index, value in zip(self._varying, self._changed, strict=True):
                self._args[index] = value
            self._changed = None
        return self._args

    def set(self, values: Sequence[Any], args: Sequence[Any]) -> None:
        """The next launches take the varying arguments ``args`` (``values``: their packed form,
        unused here)."""
        self._changed = args

    def run(self, grid: tuple[int, int, int], stream: Any, values: Sequence[Any], args: Sequence[Any]) -> None:  # fmt: skip
        """:meth:`set`, then launch over ``grid`` on ``stream`` (a torch stream; None: the
        current stream)."""
        self._changed = args
        self._triton(grid, stream)

    def launch(self, grid: tuple[int, int, int], stream: Any = None) -> None:
        """Launch again with the arguments of the last launch."""
        self._triton(grid, stream)

    def _triton(self, grid: tuple[int, int, int], stream: Any) -> None:
        if stream is None:
            self._kernel[grid](*self.args, **self._options)
        else:
            with torch.cuda.stream(stream):
                self._kernel[grid](*self.args, **self._options)


class PackedLaunch(TritonLaunch):
    """One compiled kernel's arguments in one buffer, launched with ``cuLaunchKernelEx``.

    Built by the launcher's ``bind``. Attributes: ``args`` (as :class:`TritonLaunch`), ``params``
    (the ``void *`` array handed to the driver), ``device`` (the device index it was loaded on).
    """

    is_packed = True

    def __init__(
        self, kernel: Any, args: Sequence[Any], options: dict[str, int], varying: Sequence[int],
        packing: Packing, device: int, libcuda: _Driver, knobs: Any,
    ) -> None:  # fmt: skip
        super().__init__(kernel, args, options, varying)
        types = packing.types
        if len(types) != len(args):
            raise ValueError(f"expected {len(types)} arguments, got {len(args)}")
        fixed = [i for i in range(len(args)) if i not in self._varying and types[i] is not None]
        cells = [_CELL[ty] if ty and ty[0] != "*" else "Q" if ty else "q" for ty in types]
        order = [*self._varying, *fixed]
        self._pack = struct.Struct(_HEADER + "".join(cells[i] for i in self._varying)).pack_into
        self._pack_header = struct.Struct(_HEADER[:-3]).pack_into
        self._pack_values = struct.Struct("<" + "".join(cells[i] for i in self._varying)).pack_into
        size = _HEADER_BYTES + 8 * (len(order) + packing.num_hidden)
        self._buffer = (ctypes.c_uint64 * (size // 8))()
        base = ctypes.addressof(self._buffer)
        offset = {index: _HEADER_BYTES + 8 * slot for slot, index in enumerate(order)}
        for index in order:
            struct.pack_into("<" + cells[index], self._buffer, offset[index], _value(args[index]))
        hidden = [base + _HEADER_BYTES + 8 * (len(order) + k) for k in range(packing.num_hidden)]
        addresses = [base + offset[i] for i, ty in enumerate(types) if ty is not None] + hidden
        self.params = (ctypes.c_void_p * len(addresses))(*addresses)
        self._types, self._offset = types, offset
        self.device = device
        self._block, self._shared = packing.block, packing.shared
        self._call = (ctypes.c_void_p(base), ctypes.c_void_p(packing.function), self.params, None)
        self._driver = libcuda
        self._knobs = knobs
        self._context = libcuda.current_context()
        self._thread = threading.get_ident()
        self._get_device: Any = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
        self._get_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def run(self, grid: tuple[int, int, int], stream: Any, values: Sequence[Any], args: Sequence[Any]) -> None:  # fmt: skip
        """:meth:`set` and :meth:`launch` in one write: ``values`` (the varying arguments' packed
        values, from the rule's reader), then a launch over ``grid`` on ``stream`` (a torch
        stream; None: the bound device's current one).

        Raises:
            OverflowError: a value does not fit its cell (another specialization).
            RuntimeError: the driver refused the launch (its error name in the message).
        """
        self._changed = args
        if self._blocked():
            self._triton(grid, stream)
            return
        handle = self._get_stream(self.device) if stream is None else stream.cuda_stream
        try:
            self._pack(self._buffer, 0, *grid, self._block, 1, 1, self._shared, handle, *values)
        except struct.error as exc:
            raise OverflowError(f"a launch argument does not fit its cell: {exc}") from None
        self._fire()

    def set(self, values: Sequence[Any], args: Sequence[Any]) -> None:
        """Write ``values`` (the varying arguments' packed values) for the next launches; ``args``
        are the same arguments as Python objects (for Triton's launch, the fallback).

        Raises:
            OverflowError: a value does not fit its cell (another specialization).
        """
        self._changed = args
        try:
            self._pack_values(self._buffer, _HEADER_BYTES, *values)
        except struct.error as exc:
            raise OverflowError(f"a launch argument does not fit its cell: {exc}") from None

    def launch(self, grid: tuple[int, int, int], stream: Any = None) -> None:
        """Launch with the values last written (:meth:`set` or :meth:`run`); raises as
        :meth:`run`."""
        if self._blocked():
            self._triton(grid, stream)
            return
        handle = self._get_stream(self.device) if stream is None else stream.cuda_stream
        self._pack_header(self._buffer, 0, *grid, self._block, 1, 1, self._shared, handle)
        self._fire()

    def value(self, index: int) -> Any:
        """The packed value of argument ``index`` (an int or float; None for a constexpr)."""
        ty = self._types[index]
        if ty is None:
            return None
        fmt = "<Q" if ty[0] == "*" else "<" + _CELL[ty][0]
        return struct.unpack_from(fmt, self._buffer, self._offset[index])[0]

    def _blocked(self) -> bool:
        """Whether this call must take Triton's own launch: a Triton launch hook is set (a
        callable, or a non-empty ``HookChain``), the bound device is not current, or this thread's
        current CUDA context is not the kernel's (a new thread in that context is adopted)."""
        knobs = self._knobs
        enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
        if (enter is not None and getattr(enter, "calls", enter)) or (
            leave is not None and getattr(leave, "calls", leave)
        ):
            return True
        if self._get_device() != self.device:
            return True
        if threading.get_ident() != self._thread:
            if self._driver.current_context() != self._context:
                return True
            self._thread = threading.get_ident()
        return False

    def _fire(self) -> None:
        result = self._driver.launch(*self._call)
        if result:
            raise RuntimeError(f"cuLaunchKernelEx: {self._driver.error_name(result)}")


def packing_of(compiled: Any, arg_names: Sequence[str]) -> Packing | None:
    """How to pack ``compiled`` (a ``CompiledKernel`` of a kernel with ``arg_names``), or None
    where this module does not pack it (module docstring). Loads the kernel's module."""
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
        types = param_ctypes(compiled.src.signature, arg_names)
        if types is None:
            return None
        sizes = [8 if ty[0] == "*" else _SIZE[_CELL[ty][0]] for ty in types if ty]
        entry = ptx_param_sizes(compiled.asm["ptx"])
        num_hidden = -1 if entry is None else len(entry) - len(sizes)
        if entry is None or entry[: len(sizes)] != sizes or num_hidden not in _NUM_HIDDEN:
            return None
        if entry[len(sizes) :] != [8] * num_hidden:
            return None
        _ = compiled.run  # loads the module: sets compiled.function
        return Packing(
            tuple(types), num_hidden, compiled.function, 32 * meta.num_warps, meta.shared
        )
    except Exception:  # Triton internals differ from these: keep Triton's launch
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
        elif isinstance(ty, str) and (ty[0] == "*" or ty in _CELL):
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


def _value(arg: Any) -> Any:
    """An argument as its cell holds it: a tensor's address, 0 for None, else the number."""
    if isinstance(arg, torch.Tensor):
        return arg.data_ptr()
    if arg is None:
        return 0
    if isinstance(arg, bool):
        return int(arg)
    if isinstance(arg, int | float):
        return arg
    raise TypeError(f"launch argument: expected a tensor, number or None, got {type(arg).__name__}")


class _Driver:
    """The three libcuda entry points a packed launch uses (resolved once per process)."""

    def __init__(self, lib: Any) -> None:
        self.launch = lib.cuLaunchKernelEx
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
def driver() -> _Driver | None:
    """libcuda's launch entry points, loaded lazily (None where they cannot be: no NVIDIA
    driver, a driver without ``cuLaunchKernelEx``)."""
    try:
        return _Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None
