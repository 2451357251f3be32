"""The specialization rule: what classes of argument values one compiled kernel serves.

Offers (to the rest of :mod:`kvmgr.kernels.launch`):
    CONSTEXPR, SPECIALIZED, PLAIN   parameter kinds (``PLAIN``: ``do_not_specialize``)
    param_kinds         each parameter's kind, read from a ``JITFunction`` (None: never packed)
    declared_kinds      the same, for the interpreter's kernels too
    reader              ``read(*args) -> (classes, values)``, generated for a list of kinds
    rules_agree         whether :func:`reader`'s classes match Triton's own rule (probed once)

Triton compiles a kernel per specialization of its arguments; a launch that skips Triton's
dispatch must never reuse a compiled kernel for an argument outside its class. This module is
the one place that rule lives. Per argument, in parameter order:

- a constexpr: its value (compared with ``==``, as Triton's own cache compares them);
- a tensor: its dtype, plus whether ``data_ptr()`` is a multiple of 16 unless the parameter is
  ``do_not_specialize``;
- an int: its width class (i32, i64, u64), plus whether it equals 1 and whether it is a multiple
  of 16 unless the parameter is ``do_not_specialize``;
- bools, floats and ``None`` by kind (Triton does not specialize on their values).

The classes are at least as fine as Triton's (``native_specialize_impl``), which
:func:`rules_agree` checks on probe values once per process before anything launches past Triton.
Every key built on them (a compiled kernel's, a bound launch's) therefore keeps one compiled
kernel per class. The same pass returns each argument's *value* as a packed launch stores it:
a tensor's address, ``0`` for ``None``, the number itself otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "CONSTEXPR", "PLAIN", "SPECIALIZED", "Unsupported", "declared_kinds", "param_kinds", "reader",
    "rules_agree",
]  # fmt: skip

CONSTEXPR, SPECIALIZED, PLAIN = 0, 1, 2
_I32, _I64 = 2**31, 2**63
_INT_PROBES = (
    0, 1, 2, 8, 15, 16, 17, 32, 48, -1, -2, -16, -17, _I32 - 16, _I32 - 1, -_I32, -_I32 - 1,
    -_I32 - 16, _I32, _I32 + 16, 2**32, _I64 - 16, _I64 - 1, -_I64, _I64, _I64 + 16, 2 * _I64 - 1,
)  # fmt: skip

Reader = Callable[..., tuple[tuple[Any, ...], tuple[Any, ...]]]


class Unsupported(Exception):
    """An argument the rule does not cover: the call takes Triton's own launch."""


def param_kinds(kernel: Any) -> tuple[int, ...] | None:
    """Each parameter's kind, or None where launches past Triton never apply (anything but a
    ``triton.runtime.jit.JITFunction``, or the interpreter)."""
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction

        if not isinstance(kernel, JITFunction) or knobs.runtime.interpret:
            return None
    except (ImportError, AttributeError):
        return None
    return declared_kinds(kernel)


def declared_kinds(kernel: Any) -> tuple[int, ...] | None:
    """Each parameter's kind as the kernel declares it, also for the interpreter's
    ``InterpretedFunction`` (whose owners key their launches as on a GPU); None for anything
    else."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        if isinstance(kernel, InterpretedFunction):
            kernel = JITFunction(kernel.fn, **kernel.kwargs)
        if not isinstance(kernel, JITFunction):
            return None
        return tuple(
            CONSTEXPR if p.is_constexpr else PLAIN if p.do_not_specialize else SPECIALIZED
            for p in kernel.params
        )
    except (ImportError, AttributeError, TypeError):
        return None


# Per kind, the statements that set k{i} (the class) and v{i} (the packed value) of a tensor and
# of an int in the int32 range; every other value goes through _scalar. One set of expressions
# for every reader, whatever it knows of the argument's type.
_TENSOR = {
    SPECIALIZED: "v{i} = a{i}.data_ptr(); k{i} = (a{i}.dtype, v{i} & 15 == 0)",
    PLAIN: "v{i} = a{i}.data_ptr(); k{i} = a{i}.dtype",
}
_INT = {SPECIALIZED: "v{i} = a{i}; k{i} = (a{i} == 1, a{i} % 16 == 0)", PLAIN: "v{i} = a{i}; k{i} = 'i32'"}  # fmt: skip
_IS_INT = "a{i}.__class__ is int and -I32 <= a{i} < I32"


def _statements(kind: int, hint: str) -> str:
    """The reader's code for one argument of ``kind`` and type ``hint`` (``"t"``: always a
    tensor, ``"i"``: always a number, ``"?"``: anything)."""
    if kind == CONSTEXPR:
        return "    k{i} = v{i} = a{i}\n"
    tensor, number = _TENSOR[kind], _INT[kind]
    scalar = f"k{{i}}, v{{i}} = scalar(a{{i}}, {kind == SPECIALIZED})"
    if hint == "t":  # anything else fails its attribute reads: the owner's slow path
        return f"    {tensor}\n"
    if hint == "i":
        return f"    if {_IS_INT}:\n        {number}\n    else:\n        {scalar}\n"
    return (
        f"    if isinstance(a{{i}}, Tensor):\n        {tensor}\n"
        f"    elif {_IS_INT}:\n        {number}\n    else:\n        {scalar}\n"
    )


def reader(kinds: Sequence[int], hints: str | None = None) -> Reader:
    """``read(a0, a1, ...) -> (classes, values)`` for arguments of these kinds, in order.

    ``hints`` has one letter per argument: ``"t"`` for one that is always a tensor, ``"i"`` for
    one that is always a number, ``"?"`` (the default for all) for anything; a hint only skips
    type tests, the classes are the same. One function per distinct (kinds, hints), generated
    once per process.

    Generated straight-line code (as Triton generates its own per-kernel binder): a loop over the
    arguments costs about as much as the dispatch it replaces. The class shapes never collide at
    one position (a tensor's is a dtype or a pair with a dtype; an int's a pair of bools or a
    width string), so equal classes mean equal specialization. Raises :class:`Unsupported` for an
    argument of a type the rule does not cover, ``AttributeError`` for a non-tensor where the hint
    says ``"t"``, ``TypeError`` for a wrong argument count.
    """
    hints = "?" * len(kinds) if hints is None else hints
    if len(hints) != len(kinds) or set(hints) - set("ti?"):
        raise ValueError(f"hints: expected one of 't', 'i', '?' per argument, got {hints!r}")
    return _reader(tuple(kinds), hints)


@functools.cache
def _reader(kinds: tuple[int, ...], hints: str) -> Reader:
    names = ", ".join(f"a{i}" for i in range(len(kinds)))
    body = "".join(_statements(k, h).format(i=i) for i, (k, h) in enumerate(zip(kinds, hints)))
    classes = "".join(f"k{i}, " for i in range(len(kinds)))
    values = "".join(f"v{i}, " for i in range(len(kinds)))
    source = f"def read({names}):\n{body}    return ({classes}), ({values})\n"
    namespace = {"Tensor": torch.Tensor, "I32": _I32, "scalar": _scalar}
    exec(compile(source, "<kvmgr launch rule>", "exec"), namespace)
    read: Reader = namespace["read"]
    return read


def _scalar(arg: Any, specialize: bool) -> tuple[Any, Any]:
    """(class, value) of a non-tensor argument outside the int32 fast path."""
    cls = arg.__class__
    if cls is int:
        if -_I32 <= arg < _I32:
            width = "i32"
        elif -_I64 <= arg < _I64:
            width = "i64"
        elif _I64 <= arg < 2 * _I64:
            width = "u64"
        else:
            raise Unsupported(arg)
        return ((width, arg == 1, arg % 16 == 0) if specialize else width), arg
    if cls is bool:
        return "u1", int(arg)
    if cls is float:
        return "fp32", arg
    if arg is None:
        return None, 0
    raise Unsupported(cls)


def rules_agree(specialize_impl: Any, backend: Any) -> bool:
    """Whether probe arguments that share a class also share Triton's specialization.

    ``specialize_impl(backend, arg, is_const, specialize, align)`` is Triton's own rule (the one
    its per-kernel binder calls); the probes cover each class of ints, bools, floats, ``None``
    and aligned / misaligned tensors, for every combination of the two flags.
    """
    words = torch.empty(16, dtype=torch.int32)
    halves = words.view(torch.float16)
    probes = (*_INT_PROBES, True, False, 0.0, -1.5, None, words, words[1:], words[4:], halves[1:])
    seen: dict[tuple[Any, ...], Any] = {}
    for specialize in (True, False):
        read = reader((SPECIALIZED if specialize else PLAIN,))
        for align in (True, False):
            for arg in probes:
                ((ours,), _) = read(arg)
                theirs = tuple(specialize_impl(backend, arg, False, specialize, align))
                if seen.setdefault((specialize, align, ours), theirs) != theirs:
                    return False
    return True
