"""What a compiled kernel's packed launch looks like: its parameters' types and cells.

Offers (to the rest of :mod:`kvmgr.kernels.launch`):
    Packing         how one compiled kernel is packed (types, scratch pointers, handle, block)
    packing_of      a ``CompiledKernel``'s :class:`Packing`, or None where it cannot be packed
    param_ctypes    the compiled signature's type per parameter (None: a constexpr)
    ptx_param_sizes the byte sizes of the parameters of a PTX ``.entry``
    CELL            compiled type -> ``struct`` format of its 8-byte cell

A kernel is packed only when the layout is certain: no scratch memory (``global_scratch_size``
or ``profile_scratch_size`` > 0), no clusters, PDL or cooperative launch, only types with a cell,
and a PTX ``.entry`` whose parameters are exactly those cells' sizes followed by the one or two
hidden 8-byte pointers Triton appends (a global, and from Triton 3.5 a profile scratch pointer).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = ["CELL", "Packing", "packing_of", "param_ctypes", "ptx_param_sizes"]

CELL = {  # compiled type -> struct format of its 8-byte cell
    "i1": "b7x", "i8": "b7x", "u1": "B7x", "u8": "B7x", "i16": "h6x", "u16": "H6x",
    "i32": "i4x", "u32": "I4x", "i64": "q", "u64": "Q", "fp32": "f4x", "f32": "f4x", "fp64": "d",
}  # fmt: skip
_SIZE = {"b": 1, "B": 1, "h": 2, "H": 2, "i": 4, "I": 4, "q": 8, "Q": 8, "f": 4, "d": 8}
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
        sizes = [8 if ty[0] == "*" else _SIZE[CELL[ty][0]] for ty in types if ty]
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
        elif isinstance(ty, str) and (ty[0] == "*" or ty in CELL):
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
