"""One kernel's compiled specializations, bound into reusable launches.

Offers (re-exported by :mod:`kvmgr.kernels.launch`):
    Launcher          one ``@triton.jit`` kernel: compiles each specialization once (through
                      Triton's public ``warmup``) and binds launches of it
    shared_launcher   the process-wide :class:`Launcher` of a kernel (one per kernel and mode):
                      the one owner of that kernel's compiled specializations

**Compile.** ``bind`` keys a call by the launch options, the Triton knobs that enter the compile
(``debug``, instrumentation mode, ``override_arch``, ``default_fp_fusion``), the device, and the
classes of every argument (:mod:`kvmgr.kernels.launch.rule`). A new key compiles through
``JITFunction.warmup(*args, grid=...)``, which launches nothing and finds the kernel in Triton's
own cache when it is there; the ``CompiledKernel`` and how to pack it are kept per key. The cache
is unbounded, like Triton's own; only keys that occur are stored.

**Fallbacks.** ``bind`` returns a :class:`~kvmgr.kernels.launch.packed.TritonLaunch` (Triton's
own ``kernel[grid](*args)``) instead of a packed launch:

- always, for anything but a ``triton.runtime.jit.JITFunction`` (the interpreter's
  ``InterpretedFunction`` under ``TRITON_INTERPRET=1``, autotuners, test doubles) and with
  ``direct=False``;
- for good, per launcher, when Triton's internals are not as expected: a target other than CUDA;
  a rule that disagrees with Triton's ``native_specialize_impl`` (checked once per process on probe
  values); a kernel that reads global variables (``JITFunction.run`` re-checks those on every
  call); a ``warmup`` that returns no ``CompiledKernel`` or raises (a genuine error then comes
  back from Triton's own launch);
- for one bind, when the kernel has ``pre_run_hooks``, a stages-inspection hook is set, an
  argument has a type the rule does not cover, no ``libcuda`` with ``cuLaunchKernelEx`` is
  loadable, or the compiled kernel cannot be packed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvmgr.kernels.launch.libcuda import driver
from kvmgr.kernels.launch.packed import PackedLaunch, TritonLaunch
from kvmgr.kernels.launch.rule import Unsupported, declared_kinds, param_kinds, reader, rules_agree
from kvmgr.kernels.launch.signature import Packing, packing_of

__all__ = ["Launcher", "shared_launcher"]

BoundLaunch = PackedLaunch | TritonLaunch


class _Runtime(NamedTuple):
    """What a launch past Triton reads from Triton, resolved once per process."""

    get_device: Any
    knobs: Any  # triton.knobs.runtime: debug flag, arch override, hooks
    compilation: Any  # triton.knobs.compilation: instrumentation mode
    language: Any  # triton.knobs.language: default FP fusion
    compiled_type: type


class Launcher:
    """One ``@triton.jit`` kernel's compiled specializations and their bound launches.

    Attributes:
        kernel: the kernel, as given.
        kinds: each parameter's kind (:mod:`~kvmgr.kernels.launch.rule`), or None where launches
            never go past Triton.
        declared: each parameter's kind as the kernel declares it, also under the interpreter
            (owners key their launches on it everywhere); None for anything else.
        direct: whether binds may still return packed launches (module docstring).
    """

    def __init__(self, kernel: Any, *, direct: bool = True) -> None:
        self.kernel = kernel
        self.kinds = param_kinds(kernel) if direct else None
        self.declared = declared_kinds(kernel)
        self._read = None if self.kinds is None else reader(self.kinds)
        self.direct = self.kinds is not None
        self._pre_run_hooks: list[Any] = getattr(kernel, "pre_run_hooks", [])
        self._runtime: _Runtime | None = None  # resolved by the first bind
        self._compiled: dict[tuple[Any, ...], tuple[Any, Packing | None]] = {}

    @property
    def num_compiled(self) -> int:
        """Compiled specializations held (one per key seen)."""
        return len(self._compiled)

    def bind(
        self, grid: tuple[int, ...], *args: Any, num_warps: int | None = None,
        num_stages: int | None = None, varying: Sequence[int] = (),
    ) -> BoundLaunch:  # fmt: skip
        """A reusable launch of the kernel with ``args``; compiles if needed, launches nothing.

        ``args`` holds every parameter of the kernel in order, constexprs included; ``varying``
        the positions the caller will change per launch (:meth:`PackedLaunch.run`), only ever
        within the classes of ``args``: anything else takes a new bind. Returns a
        :class:`~kvmgr.kernels.launch.packed.PackedLaunch`, or a
        :class:`~kvmgr.kernels.launch.packed.TritonLaunch` where packing does not apply (module
        docstring).
        """
        options = _options(num_warps, num_stages)
        runtime = self._runtime
        if runtime is None and self.direct:
            runtime = self._start()
        libcuda = driver()
        if runtime is not None and libcuda is not None and not self._pre_run_hooks:
            knobs, device = runtime.knobs, runtime.get_device()
            if knobs.add_stages_inspection_hook is None:
                try:
                    packing = self._packing(runtime, device, grid, args, num_warps, num_stages)
                except Unsupported:  # this call's arguments only
                    packing = None
                except Exception:  # internals differ, or a genuine error Triton's launch repeats
                    self._give_up()
                    packing = None
                if packing is not None:
                    return PackedLaunch(self.kernel, args, options, varying, packing, device,
                                        libcuda, knobs)  # fmt: skip
        return TritonLaunch(self.kernel, args, options, varying)

    def launch(self, grid: tuple[int, int, int], *args: Any, num_warps: int | None = None, stream: Any = None) -> None:  # fmt: skip
        """One launch of the kernel with ``args`` over ``grid`` on ``stream`` (a torch stream;
        None: the current one): a bind, then its launch. For one-off calls; a loop keeps the
        bound launch (:class:`~kvmgr.kernels.launch.launches.Launches`)."""
        self.bind(grid, *args, num_warps=num_warps).launch(grid, stream)

    def _packing(
        self, runtime: _Runtime, device: int, grid: tuple[int, ...], args: tuple[Any, ...],
        num_warps: int | None, num_stages: int | None,
    ) -> Packing | None:  # fmt: skip
        """How to pack the compiled kernel of ``args`` (compiled first if the key is new)."""
        knobs = runtime.knobs
        head = (device, num_warps, num_stages, knobs.debug, knobs.override_arch,
                runtime.compilation.instrumentation_mode, runtime.language.default_fp_fusion)  # fmt: skip
        assert self._read is not None
        key = (head, self._read(*args)[0])
        entry = self._compiled.get(key)
        if entry is None:
            options = _options(num_warps, num_stages)
            compiled = self.kernel.warmup(*args, grid=grid, **options)
            if not isinstance(compiled, runtime.compiled_type) or getattr(
                self.kernel, "used_global_vals", True
            ):
                self._give_up()
                return None
            entry = (compiled, packing_of(compiled, self.kernel.arg_names))
            self._compiled[key] = entry
        return entry[1]

    def _start(self) -> _Runtime | None:
        self._runtime = _direct_runtime()
        if self._runtime is None:
            self._give_up()
        return self._runtime

    def _give_up(self) -> None:
        self.direct = False
        self._runtime = None
        self._compiled.clear()


def shared_launcher(kernel: Any, direct: bool = True) -> Launcher:
    """The process-wide :class:`Launcher` of ``kernel`` (one per kernel and mode).

    Sharing one launcher per kernel shares its compiled specializations and makes a fallback hold
    for every caller of that kernel.
    """
    return _shared_launcher(kernel, bool(direct))


@functools.cache
def _shared_launcher(kernel: Any, direct: bool) -> Launcher:
    return Launcher(kernel, direct=direct)


def _options(num_warps: int | None, num_stages: int | None) -> dict[str, int]:
    options = {}
    if num_warps is not None:
        options["num_warps"] = num_warps
    if num_stages is not None:
        options["num_stages"] = num_stages
    return options


@functools.cache
def _direct_runtime() -> _Runtime | None:
    """Triton's entry points if launches past Triton are safe in this process, else None."""
    try:
        from triton import knobs
        from triton._C.libtriton import native_specialize_impl
        from triton.compiler.compiler import CompiledKernel, make_backend
        from triton.runtime.driver import driver as triton_driver

        active, runtime = triton_driver.active, knobs.runtime
        target = active.get_current_target()
        if target.backend != "cuda" or not rules_agree(native_specialize_impl, make_backend(target)):  # fmt: skip
            return None
        # every knob a bind reads must exist (AttributeError: another Triton)
        _ = (runtime.debug, runtime.override_arch, runtime.launch_enter_hook,
             runtime.launch_exit_hook, runtime.add_stages_inspection_hook,
             knobs.compilation.instrumentation_mode, knobs.language.default_fp_fusion)  # fmt: skip
        return _Runtime(active.get_current_device, runtime, knobs.compilation, knobs.language,
                        CompiledKernel)  # fmt: skip
    except Exception:  # another Triton, no driver, no device: Triton's own launch still works
        return None
