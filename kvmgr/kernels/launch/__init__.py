"""Launches of compiled Triton kernels past Triton's per-call dispatch: one mechanism, one rule.

Offers:
    Launches         an owner's bound launches of one kernel, one per specialization of the
                     arguments it changes per step (the hot path of every kvmgr kernel)
    Launcher         one kernel's compiled specializations; ``bind`` makes a bound launch
    shared_launcher  the process-wide :class:`Launcher` of a kernel
    PackedLaunch     a bound launch: arguments in one buffer, ``cuLaunchKernelEx`` per step
    TritonLaunch     the same interface over Triton's own launch (interpreter, fallbacks)

Why: ``kernel[grid](*args)`` re-derives every argument's specialization, builds a string key and
parses every argument in Python on every launch: 13-30 us of host time per launch on the H200
host, most of an eager decode step's kernel hooks. Here a step costs its owner's key (a dict
lookup), one ``struct.pack_into`` of its changing values and one ``cuLaunchKernelEx``.

Modules, dependencies one-way: ``rule`` (the specialization rule; torch only), ``signature``
(how a compiled kernel is packed), ``libcuda`` (the driver's entry points) and ``native`` (the
driver call and the cell writer, from C) <- ``cells`` (a step's cells for that writer) <-
``packed`` (bound launches; ctypes) <- ``launcher`` (compile, bind) <- ``launches`` (an owner's
set). The kernel families (``kvmgr.kernels.copy``, ``mla``, ``c128``) use this package; it uses
none of them. Importing the package imports no Triton (only a bind does).
"""

from kvmgr.kernels.launch.launcher import Launcher, shared_launcher
from kvmgr.kernels.launch.launches import Launches
from kvmgr.kernels.launch.packed import PackedLaunch, TritonLaunch

__all__ = ["Launcher", "Launches", "PackedLaunch", "TritonLaunch", "shared_launcher"]
