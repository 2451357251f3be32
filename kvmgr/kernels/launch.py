"""Direct launches of compiled Triton kernels, without ``JITFunction.run``'s per-call dispatch.

Offers (to the kernel families of :mod:`kvmgr.kernels`):
    DirectLauncher    launches one ``@triton.jit`` kernel; after the first launch of a
                      specialization, it enqueues the cached ``CompiledKernel`` itself;
                      ``bind`` returns a reusable launch with packed arguments
                      (:mod:`kvmgr.kernels.packed_launch`)
    shared_launcher   the process-wide launcher of one kernel (memoized per kernel and mode)

Why: ``kernel[grid](*args)`` re-derives the specialization of every argument, builds a string
cache key and looks it up on every launch. That costs 13-30 us of host time per launch on the
H200 host, which is most of an eager decode step's kernel hooks.

**Key.** Each call computes a key with attribute reads only. The key is at least as fine as
Triton's specialization, so calls that share a key share the compiled kernel:

- the current device, ``num_warps``, ``num_stages``, and the Triton knobs that enter its
  compile options or cache key (``debug``, instrumentation mode, ``override_arch``,
  ``default_fp_fusion``);
- every constexpr by value (compared with ``==``, as Triton's own cache compares them: it too
  serves ``1``, ``1.0`` and ``True`` with one kernel);
- per tensor: its dtype, plus whether ``data_ptr()`` is a multiple of 16 unless the parameter
  is ``do_not_specialize``;
- per int: its width class (i32, i64, u64), plus whether it equals 1 and whether it is a
  multiple of 16 unless the parameter is ``do_not_specialize``;
- bools, floats and ``None`` by kind (Triton does not specialize on their values).

**Compile and launch.** The first call for a key compiles through Triton's public
``JITFunction.warmup(*args)``, or finds the kernel in Triton's own cache; warmup does not
launch. Every call then makes the launch that ``JITFunction.run`` itself ends with:
``compiled.run(grid, stream, function, packed_metadata, launch_metadata, enter hook, exit hook,
*args)``. The stream is the current stream of the current device, so it is also a valid launch
under CUDA-graph capture. This code is the same in Triton 3.6 and 3.7.

**Fallbacks.** These use Triton's normal launch ``kernel[grid](*args, num_warps=...,
num_stages=...)``:

- always, for anything other than a ``triton.runtime.jit.JITFunction`` (the interpreter's
  ``InterpretedFunction`` under ``TRITON_INTERPRET=1``, autotuners, test doubles), under
  ``TRITON_INTERPRET=1``, and with ``direct=False``;
- for good, per launcher, when Triton's internals are not as expected: a target other than
  CUDA; key rules that disagree with Triton's ``native_specialize_impl`` (checked once per
  process on probe values); a kernel that reads global variables (``JITFunction.run``
  re-checks those on every call); a ``warmup`` that returns no ``CompiledKernel``; or a
  direct launch or compile that raises. The failing call is then launched normally, so a
  genuine error comes back from Triton's own path. The kvmgr kernels are idempotent, which
  matters only in the one case where a launch could run twice: a launch exit hook that raises;
- for a single call, when the kernel has ``pre_run_hooks``, a stages-inspection hook is set,
  an argument has another type, or not every parameter was passed positionally.

The cache of compiled kernels is unbounded, like Triton's own; only keys that occur are stored.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from kvmgr.kernels.packed_launch import PackedLaunch, TritonLaunch, pack

__all__ = ["DirectLauncher", "shared_launcher"]

_CONSTEXPR, _SPECIALIZED, _PLAIN = 0, 1, 2  # parameter kinds; _PLAIN: do_not_specialize
_I32, _I64 = 2**31, 2**63
_INT_PROBES = (
    0, 1, 2, 8, 15, 16, 17, 32, 48, -1, -2, -16, -17, _I32 - 16, _I32 - 1, -_I32, -_I32 - 1,
    -_I32 - 16, _I32, _I32 + 16, 2**32, _I64 - 16, _I64 - 1, -_I64, _I64, _I64 + 16, 2 * _I64 - 1,
)  # fmt: skip


class _Unsupported(Exception):
    """An argument the key does not cover: the call takes the normal launch."""


class _Runtime(NamedTuple):
    """What a direct launch reads from Triton, resolved once per process."""

    get_device: Any
    get_stream: Any
    knobs: Any  # triton.knobs.runtime: debug flag, arch override, hooks
    compilation: Any  # triton.knobs.compilation: instrumentation mode
    language: Any  # triton.knobs.language: default FP fusion
    compiled_type: type


class DirectLauncher:
    """Launch one ``@triton.jit`` kernel, directly once it has been compiled for the key.

    Attributes:
        kernel: the kernel, as given.
        direct: whether launches may still go direct. False for anything that is not a
            ``JITFunction``, under the interpreter, with ``direct=False``, and after a
            permanent fallback (module docstring).
    """

    def __init__(self, kernel: Any, *, direct: bool = True) -> None:
        self.kernel = kernel
        kinds = _param_kinds(kernel) if direct else None
        self._key: Any = None if kinds is None else _key_function(kinds)
        self.direct = self._key is not None
        self._pre_run_hooks: list[Any] = getattr(kernel, "pre_run_hooks", [])
        self._runtime: _Runtime | None = None  # resolved by the first direct launch
        self._compiled: dict[tuple[Any, ...], Any] = {}

    @property
    def num_compiled(self) -> int:
        """Compiled kernels held for direct launches (one per key seen)."""
        return len(self._compiled)

    def __call__(
        self,
        grid: tuple[int, ...],
        *args: Any,
        num_warps: int | None = None,
        num_stages: int | None = None,
    ) -> None:
        """Enqueue the kernel over ``grid`` (1 to 3 ints) on the current stream.

        ``args`` holds every parameter of the kernel in order, constexprs included. Raises
        whatever Triton's normal launch raises for these arguments.
        """
        runtime = self._runtime
        if runtime is None and self.direct:
            runtime = self._start()
        if runtime is not None and not self._pre_run_hooks:
            knobs, device = runtime.knobs, runtime.get_device()
            head = (device, num_warps, num_stages, knobs.debug, knobs.override_arch,
                    runtime.compilation.instrumentation_mode, runtime.language.default_fp_fusion,
                    knobs.add_stages_inspection_hook)  # fmt: skip
            try:
                key = self._key(head, args)
                compiled = self._compiled.get(key)
            except (_Unsupported, TypeError, ValueError):  # unhashable constexpr, wrong count
                key = None
            if key is not None and head[-1] is None:
                try:
                    if compiled is None:
                        compiled = self._compile(key, grid, args, num_warps, num_stages)
                    if compiled is not None:
                        self._enqueue(compiled, grid, runtime.get_stream(device), knobs, args)
                        return
                except Exception:  # internals differ, or a genuine error the normal launch repeats
                    self._give_up()
        self.kernel[grid](*args, **_options(num_warps, num_stages))

    def bind(
        self,
        grid: tuple[int, ...],
        *args: Any,
        num_warps: int | None = None,
        num_stages: int | None = None,
        packed: bool = True,
    ) -> PackedLaunch | TritonLaunch:
        """A reusable launch of the kernel with ``args``; compiles if needed, launches nothing.

        A :class:`~kvmgr.kernels.packed_launch.PackedLaunch` (``cuLaunchKernel`` from a packed
        argument buffer) when direct launches are on, ``packed`` is true and the compiled
        kernel can be packed; otherwise a
        :class:`~kvmgr.kernels.packed_launch.TritonLaunch` that calls this launcher. Either
        way, the caller may then change arguments only within the specialization of ``args``
        (see the packed launch's contract) and must bind again for anything else.
        """
        options = _options(num_warps, num_stages)
        runtime = self._runtime
        if runtime is None and self.direct and packed:
            runtime = self._start()
        if runtime is not None and packed and not self._pre_run_hooks:
            knobs, device = runtime.knobs, runtime.get_device()
            head = (device, num_warps, num_stages, knobs.debug, knobs.override_arch,
                    runtime.compilation.instrumentation_mode, runtime.language.default_fp_fusion,
                    knobs.add_stages_inspection_hook)  # fmt: skip
            try:
                key = self._key(head, args)
                compiled = self._compiled.get(key)
                if compiled is None and head[-1] is None:
                    compiled = self._compile(key, grid, args, num_warps, num_stages)
            except Exception:  # as in __call__: the normal launch reports genuine errors
                compiled = None
            if compiled is not None:
                bound = pack(self, compiled, args, options, device, knobs)
                if bound is not None:
                    return bound
        return TritonLaunch(self, args, options)

    @staticmethod
    def _enqueue(compiled: Any, grid: tuple[int, ...], stream: Any, knobs: Any, args: tuple[Any, ...]) -> None:  # fmt: skip
        """The launch ``JITFunction.run`` ends with, minus work with no effect.

        An empty hook chain (Triton's default) is passed as ``None``, which the launcher skips
        just as it would skip the empty chain, and the launch metadata, which only hooks read,
        is then not built.
        """
        enter, leave = _active(knobs.launch_enter_hook), _active(knobs.launch_exit_hook)
        meta = None
        if enter is not None or leave is not None:
            meta = compiled.launch_metadata(grid, stream, *args)
        num = len(grid)
        compiled.run(
            grid[0], grid[1] if num > 1 else 1, grid[2] if num > 2 else 1, stream,
            compiled.function, compiled.packed_metadata, meta, enter, leave, *args,
        )  # fmt: skip

    def _compile(
        self, key: tuple[Any, ...], grid: tuple[int, ...], args: tuple[Any, ...],
        num_warps: int | None, num_stages: int | None,
    ) -> Any:  # fmt: skip
        """The compiled kernel for a new key via Triton's public ``warmup``; None: gave up."""
        compiled = self.kernel.warmup(*args, grid=grid, **_options(num_warps, num_stages))
        assert self._runtime is not None
        if not isinstance(compiled, self._runtime.compiled_type) or getattr(
            self.kernel, "used_global_vals", True
        ):
            self._give_up()
            return None
        self._compiled[key] = compiled
        return compiled

    def _start(self) -> _Runtime | None:
        self._runtime = _direct_runtime()
        if self._runtime is None:
            self._give_up()
        return self._runtime

    def _give_up(self) -> None:
        self.direct = False
        self._runtime = None
        self._compiled.clear()


def shared_launcher(kernel: Any, direct: bool = True) -> DirectLauncher:
    """The process-wide :class:`DirectLauncher` of ``kernel`` (one per kernel and mode).

    Sharing one launcher per kernel shares its compiled kernels and makes a fallback hold for
    every caller of that kernel.
    """
    return _shared_launcher(kernel, bool(direct))


@functools.cache
def _shared_launcher(kernel: Any, direct: bool) -> DirectLauncher:
    return DirectLauncher(kernel, direct=direct)


def _active(hook: Any) -> Any:
    """``hook``, or None for Triton's empty ``HookChain`` (the launcher skips None hooks)."""
    return None if hook is None or getattr(hook, "calls", True) == [] else hook


def _options(num_warps: int | None, num_stages: int | None) -> dict[str, int]:
    options = {}
    if num_warps is not None:
        options["num_warps"] = num_warps
    if num_stages is not None:
        options["num_stages"] = num_stages
    return options


def _param_kinds(kernel: Any) -> tuple[int, ...] | None:
    """Each parameter's kind, or None where direct launches never apply."""
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction

        if not isinstance(kernel, JITFunction) or knobs.runtime.interpret:
            return None
        return tuple(
            _CONSTEXPR if p.is_constexpr else _PLAIN if p.do_not_specialize else _SPECIALIZED
            for p in kernel.params
        )
    except (ImportError, AttributeError):
        return None


def _key_function(kinds: tuple[int, ...]) -> Any:
    """``key(head, args)``: the launch key of one call, as generated straight-line code.

    Generated (as Triton generates its per-kernel binder) because a loop over the arguments
    costs about as much as the dispatch it replaces. Per argument, in parameter order:
    constexprs give their value; tensors give ``(dtype,
    aligned)``, or ``dtype`` for ``do_not_specialize``; ints in the int32 range give ``(== 1,
    % 16 == 0)``, or ``"i32"`` for ``do_not_specialize``; anything else goes through
    :func:`_scalar_key`, which raises ``_Unsupported`` for an uncovered type. These shapes never
    collide at one position. A wrong argument count raises ``ValueError``.
    """
    names = [f"a{i}" for i in range(len(kinds))]
    parts = []
    for name, kind in zip(names, kinds):
        if kind == _CONSTEXPR:
            parts.append(name)
        elif kind == _SPECIALIZED:
            parts.append(f"({name}.dtype, {name}.data_ptr() % 16 == 0) if isinstance({name}, "
                         f"Tensor) else ({name} == 1, {name} % 16 == 0) if {name}.__class__ is "
                         f"int and -I32 <= {name} < I32 else scalar({name}, True)")  # fmt: skip
        else:
            parts.append(f"{name}.dtype if isinstance({name}, Tensor) else 'i32' if "
                         f"{name}.__class__ is int and -I32 <= {name} < I32 else "
                         f"scalar({name}, False)")  # fmt: skip
    body = "".join(f"\n        {part}," for part in parts)
    unpack = f"    ({', '.join(names)},) = args\n"
    source = f"def key(head, args):\n{unpack}    return (\n        head,{body}\n    )\n"
    namespace = {"Tensor": torch.Tensor, "I32": _I32, "scalar": _scalar_key}
    exec(compile(source, "<kvmgr direct-launch key>", "exec"), namespace)
    return namespace["key"]


def _scalar_key(arg: Any, specialize: bool) -> Any:
    """What Triton may specialize a non-tensor runtime argument on, or more."""
    cls = arg.__class__
    if cls is int:
        if -_I32 <= arg < _I32:
            width = "i32"
        elif -_I64 <= arg < _I64:
            width = "i64"
        elif _I64 <= arg < 2 * _I64:
            width = "u64"
        else:
            raise _Unsupported(arg)
        return (width, arg == 1, arg % 16 == 0) if specialize else width
    if cls is bool:
        return "u1"
    if cls is float:
        return "fp32"
    if arg is None:
        return None
    raise _Unsupported(cls)


@functools.cache
def _direct_runtime() -> _Runtime | None:
    """Triton's launch entry points if direct launches are safe in this process, else None."""
    try:
        from triton import knobs
        from triton._C.libtriton import native_specialize_impl
        from triton.compiler.compiler import CompiledKernel, make_backend
        from triton.runtime.driver import driver

        active, runtime = driver.active, knobs.runtime
        target = active.get_current_target()
        if target.backend != "cuda" or not _rules_agree(
            native_specialize_impl, make_backend(target)
        ):
            return None
        # every knob a launch reads must exist (AttributeError: another Triton)
        _ = (runtime.debug, runtime.override_arch, runtime.launch_enter_hook,
             runtime.launch_exit_hook, runtime.add_stages_inspection_hook,
             knobs.compilation.instrumentation_mode, knobs.language.default_fp_fusion)  # fmt: skip
        return _Runtime(active.get_current_device, active.get_current_stream, runtime,
                        knobs.compilation, knobs.language, CompiledKernel)  # fmt: skip
    except Exception:  # another Triton, no driver, no device: the normal launch still works
        return None


def _rules_agree(specialize_impl: Any, backend: Any) -> bool:
    """Whether probe arguments that share a key also share Triton's specialization.

    ``specialize_impl(backend, arg, is_const, specialize, align)`` is Triton's own rule (the
    one its per-kernel binder calls); the probes cover each key class of ints, bools, floats,
    ``None`` and aligned / misaligned tensors, for every combination of the two flags.
    """
    words = torch.empty(16, dtype=torch.int32)
    halves = words.view(torch.float16)
    probes = (*_INT_PROBES, True, False, 0.0, -1.5, None, words, words[1:], words[4:], halves[1:])
    seen: dict[tuple[Any, ...], Any] = {}
    for specialize in (True, False):
        key = _key_function((_SPECIALIZED if specialize else _PLAIN,))
        for align in (True, False):
            for arg in probes:
                ours = key(None, (arg,))
                theirs = tuple(specialize_impl(backend, arg, False, specialize, align))
                if seen.setdefault((specialize, align, ours), theirs) != theirs:
                    return False
    return True
