"""Bound launches: one compiled specialization with its arguments packed, launched by the driver.

Offers (to the rest of :mod:`kvmgr.kernels.launch`):
    PackedLaunch    the arguments in one ctypes buffer; ``run`` / ``launch`` call
                    ``cuLaunchKernelEx`` with the step's values written in one ``pack_into``
    TritonLaunch    the same interface over Triton's own launch (the fallback)

How a compiled kernel is packed (:class:`~kvmgr.kernels.launch.signature.Packing`) is read from
its signature and PTX by :mod:`kvmgr.kernels.launch.signature`; the driver's entry points come
from :mod:`kvmgr.kernels.launch.libcuda`.

Why: Triton's launch parses every argument in Python on every call (10-20 us on the H200 host,
past ``JITFunction.run``'s own dispatch). A bound launch keeps the arguments where the driver
reads them; a step writes its few changing values and calls the driver once.

**Buffer.** One ctypes buffer holds, in order: the ``CUlaunchConfig`` (grid, block
``32 * num_warps``, shared bytes, stream, no attributes: what Triton's launcher passes for these
kernels); one 8-byte cell per *varying* argument (the positions the owner changes per step; a
scratch cell where the compiled signature has none, e.g. an int equal to 1, which Triton turns
into a constant); the other arguments' cells; and the hidden scratch pointers Triton appends
(one, or two from Triton 3.5), passed NULL. A step then costs a ``struct.pack_into`` of its
values (and one of the grid and stream where they differ from the last launch's) and one driver
call: from C (:mod:`kvmgr.kernels.launch.native`, one ``METH_O`` call of a record in C memory)
where that module builds, else through ctypes. The driver copies the parameters at the call, so
later writes never change an enqueued or captured launch.

**Fallback per call** (Triton's own launch, with the same Python arguments): a Triton launch hook
is set (profilers), the current device is not the bound one, or the calling thread's current CUDA
context is not the one the kernel was loaded in.

**Contract.** Values may change only within the specialization the launch was bound for (the
owner keys its bound launches on :func:`kvmgr.kernels.launch.rule.reader`'s classes); a value
that does not fit its cell raises ``OverflowError``. One bound launch is not thread-safe.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvmgr.kernels.launch.cells import StepCells
from kvmgr.kernels.launch.libcuda import Libcuda
from kvmgr.kernels.launch.native import Record, native_fire
from kvmgr.kernels.launch.signature import CELL, Packing

__all__ = ["PackedLaunch", "TritonLaunch"]

_HEADER = "<7I4xQ16x"  # CUlaunchConfig: grid, block, shared, pad, stream, attrs NULL, 0 attrs
_HEADER_BYTES = struct.calcsize(_HEADER)  # 56
_get_ident = threading.get_ident


class _Never:
    """A hook chain the knobs never hold (for a Triton whose launch hooks are not chains)."""

    calls = (None,)


_NEVER = _Never()


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
    (the ``void *`` array handed to the driver), ``device`` (the device index it was loaded on),
    ``stream_handle`` (the raw stream handle of the last launch if it went through the driver;
    None before the first and after one through Triton's launch).
    """

    is_packed = True

    def __init__(
        self, kernel: Any, args: Sequence[Any], options: dict[str, int], varying: Sequence[int],
        packing: Packing, device: int, libcuda: Libcuda, knobs: Any,
    ) -> None:  # fmt: skip
        super().__init__(kernel, args, options, varying)
        types = packing.types
        if len(types) != len(args):
            raise ValueError(f"expected {len(types)} arguments, got {len(args)}")
        cells = [CELL[ty] if ty and ty[0] != "*" else "Q" if ty else "q" for ty in types]
        self._pack_header = struct.Struct(_HEADER[:-3]).pack_into
        self._grid: Any = None  # the grid and stream handle in the buffer's header
        # the stream handle in the header: that of the last launch through the driver, None
        # before one and after a launch through Triton's (the header is rewritten next time)
        self.stream_handle: Any = None
        self._pack_values = struct.Struct("<" + "".join(cells[i] for i in self._varying)).pack_into
        base, offset = self._pack_buffer(args, cells, packing)
        self._types, self._offset, self._formats = types, offset, cells
        self.device = device
        self._block, self._shared = packing.block, packing.shared
        self._call = (ctypes.c_void_p(base), ctypes.c_void_p(packing.function), self.params, None)
        self._driver = libcuda
        # the driver call from C where it can be built (kvmgr.kernels.launch.native), else ctypes
        address = getattr(libcuda, "launch_address", None)
        self._native = native_fire() if address else None
        self._record = None if self._native is None else Record(
            address, base, packing.function, ctypes.addressof(self.params))  # fmt: skip
        self._record_address = None if self._record is None else self._record.address
        self._knobs = knobs
        self._context = libcuda.current_context()
        self._thread = threading.get_ident()
        self._get_device: Any = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
        self._get_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        # Triton's two launch hook chains as bound: while the knobs hold these very chains and
        # both are empty, a launch skips ``_blocked``'s general test (a sentinel never matches)
        enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
        chains = isinstance(getattr(enter, "calls", None), list) and isinstance(getattr(leave, "calls", None), list)  # fmt: skip
        self._chains = (enter, leave) if chains else (_NEVER, _NEVER)
        # what every launch reads and nothing changes: one unpack costs less than the reads
        self._hot = (*self._chains, knobs, device, self._get_device, self._get_stream, self._native, self._record_address)  # fmt: skip

    def _pack_buffer(self, args: Sequence[Any], cells: list[str], packing: Packing) -> tuple[int, dict[int, int]]:  # fmt: skip
        """Allocate the buffer (header, the varying arguments' cells, the other arguments',
        the hidden pointers), write every argument's value into its cell and point ``params``
        at the cells; ``(buffer address, argument index -> cell offset)``."""
        types = packing.types
        fixed = [i for i in range(len(args)) if i not in self._varying and types[i] is not None]
        order = [*self._varying, *fixed]
        size = _HEADER_BYTES + 8 * (len(order) + packing.num_hidden)
        self._buffer = (ctypes.c_uint64 * (size // 8))()
        base = ctypes.addressof(self._buffer)
        offset = {index: _HEADER_BYTES + 8 * slot for slot, index in enumerate(order)}
        for index in order:
            struct.pack_into("<" + cells[index], self._buffer, offset[index], _value(args[index]))
        hidden = [base + _HEADER_BYTES + 8 * (len(order) + k) for k in range(packing.num_hidden)]
        addresses = [base + offset[i] for i, ty in enumerate(types) if ty is not None] + hidden
        self.params = (ctypes.c_void_p * len(addresses))(*addresses)
        return base, offset

    def run(self, grid: tuple[int, int, int], stream: Any = None, values: Sequence[Any] | None = None, args: Sequence[Any] | None = None) -> None:  # fmt: skip
        """:meth:`set`, then :meth:`launch`: ``values`` (the varying arguments' packed values,
        from the rule's reader), then a launch over ``grid`` on ``stream`` (a torch stream; None:
        the bound device's current one); the header is rewritten only when the grid or stream
        differs from the last launch's. ``values`` None: no new values (:meth:`launch`, which is
        this method: one Python call per launch either way), or values already written to the
        cells (:meth:`step_cells`) for the ``args`` given.

        Raises:
            OverflowError: a value does not fit its cell (another specialization).
            RuntimeError: the driver refused the launch (its error name in the message).
        """
        if args is not None:  # Triton's launch (the fallback) takes the Python arguments
            self._changed = args
        if values is not None:  # as set(), inlined: the per-step path
            try:
                self._pack_values(self._buffer, _HEADER_BYTES, *values)
            except struct.error as exc:
                raise OverflowError(f"a launch argument does not fit its cell: {exc}") from None
        # the usual case, tested inline: the knobs hold the hook chains of the bind, both empty,
        # and the call comes from the bound device and thread (else _blocked decides)
        enter, leave, knobs, device, get_device, get_stream, native, record = self._hot
        if not (
            knobs.launch_enter_hook is enter and knobs.launch_exit_hook is leave
            and not enter.calls and not leave.calls and get_device() == device
            and _get_ident() == self._thread
        ) and self._blocked():  # fmt: skip
            self.stream_handle = None
            self._triton(grid, stream)
            return
        handle = get_stream(device) if stream is None else stream.cuda_stream
        # a loop relaunches with the same grid (often the very tuple) and stream
        if handle != self.stream_handle or (grid is not self._grid and grid != self._grid):
            self._pack_header(self._buffer, 0, *grid, self._block, 1, 1, self._shared, handle)
            self._grid, self.stream_handle = grid, handle
        result = self._driver.launch(*self._call) if native is None else native(record)
        if result:
            raise RuntimeError(f"cuLaunchKernelEx: {self._driver.error_name(result)}")

    # launch(grid, stream=None): launch with the values last written (set() or run()); raises
    # as run(). The same function as run without values, so that neither adds a Python call.
    launch = run

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

    def step_cells(self, known: Sequence[int], aligned: bool, pointers: Sequence[int], words: Sequence[tuple[int, Any]]) -> StepCells:  # fmt: skip
        """What :func:`~kvmgr.kernels.launch.cells.cell_writer` writes for a step:
        the tensors after ``known`` (their pointers compared) to the cells of the varying
        arguments ``pointers``, and ``words`` (``(index, value)`` of varying arguments, e.g. a
        step's ints) packed as :meth:`set` packs them. A launch then passes the same arguments
        to :meth:`run` as ``args``, without ``values``.

        Raises:
            OverflowError: a value does not fit its cell.
        """
        base = ctypes.addressof(self._buffer)
        try:
            packed = [(base + self._offset[i], int.from_bytes(struct.pack("<" + self._formats[i], _value(v)).ljust(8, b"\0"), "little")) for i, v in words]  # fmt: skip
        except struct.error as exc:
            raise OverflowError(f"a launch argument does not fit its cell: {exc}") from None
        return StepCells(known, aligned, [base + self._offset[i] for i in pointers], packed, self)

    def value(self, index: int) -> Any:
        """The packed value of argument ``index`` (an int or float; None for a constexpr)."""
        ty = self._types[index]
        if ty is None:
            return None
        fmt = "<Q" if ty[0] == "*" else "<" + CELL[ty][0]
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
