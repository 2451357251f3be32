"""The launch package: the specialization rule against Triton's own, binds and their fallbacks,
packed launches against a fake libcuda, an owner's ``Launches``, and where the package sits.

The rule tests build real ``JITFunction`` objects (no GPU needed) and compare the classes with
Triton's ``native_specialize_impl``. Binds use a recording ``JITFunction`` subclass and a fake
runtime; one test runs Triton's real compile (sm_90) of every kvmgr hook kernel behind a stub
driver and a fake libcuda in a subprocess, and the ``gpu`` tests launch for real, eagerly, on
streams and inside a CUDA graph.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.knobs import HookChain
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from kvmgr import _native
from kvmgr._tensor_guard import tensor_guard
from kvmgr.kernels.launch import (
    Launcher,
    Launches,
    PackedLaunch,
    TritonLaunch,
    libcuda,
    native,
    packed,
    rule,
    shared_launcher,
    signature,
)
from kvmgr.kernels.launch import launcher as launcher_module
from kvmgr.kernels.launch.cells import StepCells, cell_writer

ROOT = Path(__file__).resolve().parents[2]


def _body(x_ptr, n, m, f, b, FLAG: tl.constexpr):  # type: ignore[no-untyped-def]
    pass  # never compiled: the rule and bind tests only need the signature


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale + n, mask=mask)


def _classes(monkeypatch: pytest.MonkeyPatch, kernel: JITFunction, *args: object) -> tuple[object, ...]:  # fmt: skip
    """The rule's classes of ``args`` for ``kernel`` (the interpreter off: conftest sets it)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kinds = rule.param_kinds(kernel)
    assert kinds is not None
    return rule.reader(kinds)(*args)[0]


# --- the rule --------------------------------------------------------------------------------


def test_classes_separate_what_triton_specializes_on(monkeypatch):
    kernel = JITFunction(_body, do_not_specialize=["m"])
    words = torch.arange(64, dtype=torch.int32)
    base = (words, 17, 17, 0.5, True, 3)
    same = [  # another call that must share the compiled kernel
        (words.clone(), 17, 17, 0.5, True, 3),
        (words[4:], 33, 17, -2.0, False, 3),  # 16 bytes further; ints 17, 33: neither 1 nor 16k
        (words, 17, 1, 0.5, True, 3),  # m is do_not_specialize: 1 and 16 are not special
        (words, 17, 2**31 - 1, 0.5, True, 3),  # still int32
    ]
    different = [  # another call that must compile (or find) another kernel
        (words[1:], 17, 17, 0.5, True, 3),  # misaligned pointer
        (words.long(), 17, 17, 0.5, True, 3),  # dtype
        (words, 16, 17, 0.5, True, 3),  # divisible by 16
        (words, 1, 17, 0.5, True, 3),  # equal to 1
        (words, 2**31 + 1, 17, 0.5, True, 3),  # int64
        (words, 2**63 + 1, 17, 0.5, True, 3),  # uint64
        (words, 17, 2**31, 0.5, True, 3),  # int64 for the unspecialized int too
        (None, 17, 17, 0.5, True, 3),  # None is a constexpr to Triton
        (words, 17, 17, 0.5, True, 4),  # constexpr value
        (words, 17, 17, 1, True, 3),  # an int where a float was
    ]
    assert all(_classes(monkeypatch, kernel, *a) == _classes(monkeypatch, kernel, *base) for a in same)  # fmt: skip
    classes = [_classes(monkeypatch, kernel, *args) for args in [base, *different]]
    assert len(set(classes)) == len(classes)


def test_do_not_specialize_pointers_ignore_alignment(monkeypatch):
    kernel = JITFunction(_body, do_not_specialize=["x_ptr"])
    words = torch.arange(8, dtype=torch.int32)
    first = _classes(monkeypatch, kernel, words, 3, 3, 1.0, True, 0)
    assert first == _classes(monkeypatch, kernel, words[1:], 3, 3, 1.0, True, 0)
    assert first != _classes(monkeypatch, kernel, words.half(), 3, 3, 1.0, True, 0)


_BACKEND = make_backend(GPUTarget("cuda", 90, 32))
_TENSOR = st.tuples(st.sampled_from([torch.int16, torch.float32]), st.integers(0, 7))
_INT = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.integers(-70, 70),
    st.sampled_from([2**31 - 16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 16, 2**63]),
)
_ARG = st.one_of(_INT, st.booleans(), st.floats(allow_nan=False), st.none(), _TENSOR)


def _arg(drawn: object) -> object:
    """A drawn argument: ``(dtype, element offset)`` is a view into one buffer (aligned or not)."""
    buffer = torch.zeros(64, dtype=torch.uint8)
    return buffer.view(drawn[0])[drawn[1] :] if isinstance(drawn, tuple) else drawn


@settings(max_examples=500, deadline=None)
@given(_ARG, _ARG, st.booleans(), st.booleans())
def test_equal_classes_mean_equal_triton_specialization(first, second, specialize, align):
    # the classes may be finer than Triton's specialization, never coarser: whenever two
    # arguments share a class, Triton's own rule (the one its per-kernel binder calls) agrees
    args = [_arg(a) for a in (first, second)]
    read = rule.reader((rule.SPECIALIZED if specialize else rule.PLAIN,))
    ours = [read(a)[0] for a in args]
    theirs = [native_specialize_impl(_BACKEND, a, False, specialize, align) for a in args]
    if ours[0] == ours[1]:
        assert theirs[0] == theirs[1]


@settings(max_examples=300, deadline=None)
@given(_TENSOR, _INT, st.booleans())
def test_type_hints_skip_tests_but_give_the_same_classes_and_values(tensor, number, specialize):
    kind = rule.SPECIALIZED if specialize else rule.PLAIN
    args = (_arg(tensor), number)
    try:
        general = rule.reader((kind, kind))(*args)
    except rule.Unsupported:  # beyond u64: neither reader covers it
        with pytest.raises(rule.Unsupported):
            rule.reader((kind, kind), "ti")(*args)
        return
    assert rule.reader((kind, kind), "ti")(*args) == general
    assert general[1][0] == args[0].data_ptr() and general[1][1] == number


def test_readers_reject_bad_hints_and_uncovered_types():
    with pytest.raises(ValueError, match="hints"):
        rule.reader((rule.PLAIN,), "x")
    with pytest.raises(rule.Unsupported):
        rule.reader((rule.PLAIN,))(np.int64(3))  # a numpy int: Triton's own launch takes it
    with pytest.raises(AttributeError):
        rule.reader((rule.PLAIN,), "t")(3)  # not a tensor where the owner said one: its slow path
    assert rule.reader((rule.PLAIN, rule.CONSTEXPR))(None, 8) == ((None, 8), (0, 8))


def test_rule_probe_accepts_this_triton_and_rejects_another_rule():
    assert rule.rules_agree(native_specialize_impl, _BACKEND)

    def divisible_by_eight(backend, arg, is_const, specialize, align):  # a hypothetical Triton
        kind, attr = native_specialize_impl(backend, arg, is_const, specialize, align)
        if type(arg) is int and specialize and arg % 8 == 0:
            attr = (attr or "") + "D8"
        return kind, attr

    assert not rule.rules_agree(divisible_by_eight, _BACKEND)


# --- binds, against a fake runtime and a fake libcuda ----------------------------------------

_PTX = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u32 k_param_1,
	.param .u32 k_param_2,
	.param .f32 k_param_3,
	.param .u8 k_param_4,
	.param .u64 .ptr .global .align 1 k_param_5,
	.param .u64 .ptr .global .align 1 k_param_6
)
"""
_BODY_SIGNATURE = {"x_ptr": "*i32", "n": "i32", "m": "i32", "f": "fp32", "b": "u1", "FLAG": "constexpr"}  # fmt: skip


class FakeCompiled:
    """A ``CompiledKernel`` as ``packing_of`` reads it (the signature of ``_body``)."""

    function, run = 1234, None

    def __init__(self, log=None, **meta):
        self.metadata = SimpleNamespace(num_warps=4, shared=96, num_ctas=1, **meta)
        self.src = SimpleNamespace(signature=dict(_BODY_SIGNATURE))
        self.asm = {"ptx": _PTX}


class RecordingJIT(JITFunction):
    """A real ``JITFunction`` whose own launch and ``warmup`` record instead of compiling."""

    def __init__(self, fn, compiled=FakeCompiled, **kw):
        super().__init__(fn, **kw)
        self.log, self.make_compiled = [], compiled

    def __getitem__(self, grid):
        return lambda *args, **options: self.log.append(("triton", grid, options, args))

    def warmup(self, *args, grid, **options):
        self.log.append(("warmup", grid, options, args))
        return self.make_compiled(self.log)


_C_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)  # fmt: skip


class FakeLibcuda:
    """libcuda's three entry points as a packed launch calls them; records each launch: the
    launch config and every parameter cell, read at the time of the call. ``native``: it also
    offers a C entry point (a ctypes callback into ``launch``) for the C call of
    :mod:`kvmgr.kernels.launch.native`; else packed launches call ``launch`` through ctypes."""

    def __init__(self, native=False, num_params=7):
        self.calls, self.context, self.num_params = [], 1, num_params
        self._entry = _C_LAUNCH(self._from_c)  # kept alive as long as the fake
        self.launch_address = ctypes.cast(self._entry, ctypes.c_void_p).value if native else None

    def _from_c(self, config, function, params, extra):
        array = (ctypes.c_void_p * self.num_params).from_address(params)
        return self.launch(ctypes.c_void_p(config), ctypes.c_void_p(function), array, extra)

    def launch(self, config, function, params, extra):
        grid, block, shared, stream, num_attrs = _config(config.value)
        cells = [ctypes.string_at(params[i], 8) for i in range(len(params))]  # values now
        self.calls.append({"grid": grid, "block": block, "shared": shared, "stream": stream,
                           "num_attrs": num_attrs, "function": function.value, "extra": extra,
                           "cells": cells})  # fmt: skip
        return 0

    def current_context(self):
        return self.context

    def error_name(self, result):
        return f"error {result}"


def _config(address: int) -> tuple[tuple[int, ...], tuple[int, ...], int, int, int]:
    """A ``CUlaunchConfig`` at ``address``: grid, block, shared bytes, stream, attribute count."""
    x, y, z, bx, by, bz, shared, stream, attrs, num_attrs = struct.unpack("<7I4xQQI4x", ctypes.string_at(address, 56))  # fmt: skip
    assert attrs == 0
    return (x, y, z), (bx, by, bz), shared, stream, num_attrs


def _read(cell: bytes, fmt: str) -> object:
    return struct.unpack_from(fmt, cell)[0]


@pytest.fixture(params=["ctypes", "native"])
def runtime(monkeypatch, request):
    """A fake process runtime (device 0, current stream 55) and libcuda in place of the real;
    packed launches call the fake driver through ctypes, or from C (``native``)."""
    if request.param == "native" and native.native_fire() is None:
        pytest.skip("the C launch module cannot be built here (no C compiler?)")
    device = [0]
    knobs = SimpleNamespace(debug=False, override_arch=None, launch_enter_hook=HookChain(),
                            launch_exit_hook=HookChain(), add_stages_inspection_hook=None)  # fmt: skip
    fake = launcher_module._Runtime(lambda: device[0], knobs, SimpleNamespace(instrumentation_mode=""),
                                    SimpleNamespace(default_fp_fusion=True), FakeCompiled)  # fmt: skip
    libcuda = FakeLibcuda(native=request.param == "native")
    monkeypatch.setattr(launcher_module, "_direct_runtime", lambda: fake)
    monkeypatch.setattr(launcher_module, "driver", lambda: libcuda)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: device[0], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 55, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return SimpleNamespace(device=device, knobs=knobs, libcuda=libcuda)


def _paths(kernel: RecordingJIT) -> list[str]:
    return [entry[0] for entry in kernel.log]


def test_each_new_key_compiles_once_then_binds_packed_launches(runtime):
    kernel = RecordingJIT(_body, do_not_specialize=["m"])
    launcher = Launcher(kernel)
    aligned = torch.arange(8, dtype=torch.int32)
    shifted = torch.arange(9, dtype=torch.int32)[1:]  # 4 bytes past a 16-byte boundary
    steps = [  # (args, new key?)
        ((aligned, 16, 5, 1.0, True, 7), True), ((aligned, 16, 6, 2.0, False, 7), False),
        ((shifted, 16, 5, 1.0, True, 7), True), ((shifted, 32, 5, 1.0, True, 7), False),
        ((aligned.long(), 16, 5, 1.0, True, 7), True), ((aligned, 17, 5, 1.0, True, 7), True),
        ((aligned, 16, 5, 1.0, True, 8), True), ((aligned, 16, 5, 1.0, True, 7), False),
    ]  # fmt: skip
    expected = []
    for args, is_new in steps:
        bound = launcher.bind((3, 1, 1), *args, num_warps=4)
        assert type(bound) is PackedLaunch and bound.device == 0
        expected += ["warmup"] if is_new else []
    runtime.knobs.debug = True  # a knob that enters Triton's compile options
    launcher.bind((3, 1, 1), *steps[0][0], num_warps=4)
    runtime.device[0] = 1  # a kernel compiled for device 0 is not bound on device 1
    launcher.bind((3, 2, 1), *steps[0][0], num_warps=4)
    launcher.bind((3, 2, 1), *steps[0][0], num_warps=8)  # nor with other launch options
    assert _paths(kernel) == [*expected, "warmup", "warmup", "warmup"]
    assert launcher.direct and launcher.num_compiled == 8
    assert kernel.log[-1][1:3] == ((3, 2, 1), {"num_warps": 8})  # warmup got the grid, options
    assert runtime.libcuda.calls == []  # binding launches nothing


@pytest.mark.parametrize("internal", ["no runtime", "warmup result", "globals", "warmup raises"])
def test_fallback_is_permanent_when_internals_differ(monkeypatch, runtime, internal):
    def make(log):
        if internal == "warmup raises":
            raise TypeError("warmup signature differs")
        return object() if internal == "warmup result" else FakeCompiled()

    kernel = RecordingJIT(_body, compiled=make)
    if internal == "no runtime":  # not CUDA, another Triton, or a rule probe that disagreed
        monkeypatch.setattr(launcher_module, "_direct_runtime", lambda: None)
    if internal == "globals":  # JITFunction.run re-checks globals on every call; we would not
        kernel.used_global_vals = {("G", 0): (1, {})}
    launcher = Launcher(kernel)
    words = torch.arange(8, dtype=torch.int32)
    for _ in range(3):
        bound = launcher.bind((2, 1, 1), words, 3, 3, 1.0, True, 0, num_stages=2)
        assert type(bound) is TritonLaunch
        bound.launch((2, 1, 1))
    compiled_once = ["warmup"] if internal != "no runtime" else []
    assert _paths(kernel) == [*compiled_once, "triton", "triton", "triton"]
    assert kernel.log[-1][1:3] == ((2, 1, 1), {"num_stages": 2})  # the caller's grid, options
    assert not launcher.direct and launcher.num_compiled == 0


@pytest.mark.parametrize("case", ["pre-run hook", "stages hook", "numpy int", "no libcuda", "scratch"])  # fmt: skip
def test_some_binds_take_tritons_launch_and_packing_stays_on(monkeypatch, runtime, case):
    kernel = RecordingJIT(_body)
    words = torch.arange(8, dtype=torch.int32)
    args: tuple[object, ...] = (words, 3, 3, 1.0, True, 0)
    if case == "pre-run hook":
        kernel.add_pre_run_hook(lambda *a, **k: None)
    elif case == "stages hook":
        runtime.knobs.add_stages_inspection_hook = lambda: ("key", "hash")
    elif case == "numpy int":
        args = (words, np.int64(3), 3, 1.0, True, 0)
    elif case == "no libcuda":
        monkeypatch.setattr(launcher_module, "driver", lambda: None)
    else:  # a compiled kernel that needs scratch memory is not packed
        kernel.make_compiled = lambda log: FakeCompiled(global_scratch_size=64)
    launcher = Launcher(kernel)
    assert type(launcher.bind((2, 1, 1), *args)) is TritonLaunch and launcher.direct


def test_interpreter_and_opt_out_always_take_tritons_launch(monkeypatch):
    # under TRITON_INTERPRET=1 the decorator gives an InterpretedFunction; a hand-made
    # JITFunction is refused too while the variable is set
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = InterpretedFunction(_scale_kernel.fn)
    assert not Launcher(interpreted).direct
    assert not Launcher(JITFunction(_body)).direct
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not Launcher(JITFunction(_body), direct=False).direct
    assert not Launcher(object()).direct  # a test double
    # and the interpreted kernel really runs through a bound launch, arguments set per run (under
    # TRITON_INTERPRET=1 as in use: the interpreter's first run imports triton's gluon package,
    # which asserts the variable is set once the interpreter has patched triton.language)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(3)
    bound = Launcher(interpreted).bind((3,), torch.empty(1), torch.empty(1), 1, 0.5, 16,
                                       num_warps=1, varying=(0, 1, 2))  # fmt: skip
    assert type(bound) is TritonLaunch and not bound.is_packed
    for n in (37, 5):
        x = torch.randn(n, generator=gen)
        out = torch.full_like(x, float("nan"))
        bound.run((3, 1, 1), None, (0, 0, n), (x, out, n))
        assert torch.equal(out, x * 0.5 + n) and bound.args[:3] == [x, out, n]


def test_shared_launcher_is_one_per_kernel_and_mode():
    kernel = object()
    assert shared_launcher(kernel) is shared_launcher(kernel, True)
    assert shared_launcher(kernel, False) is not shared_launcher(kernel)


# --- packed launches: the buffer, the driver call, the per-call fallbacks --------------------


def _packed(runtime, kernel=None, args=None, varying=(0, 1)):
    types = ("*i32", "i32", "i32", "fp32", "u1", None)
    packing = signature.Packing(types, 2, 1234, 128, 96)
    words = torch.arange(8, dtype=torch.int32)
    args = list(args or (words, 7, 9, 0.25, True, 64))
    return packed.PackedLaunch(kernel or RecordingJIT(_body), args, {}, varying, packing, 0,
                               runtime.libcuda, runtime.knobs)  # fmt: skip


def test_packed_launch_writes_config_and_cells_and_calls_the_driver(runtime):
    bound = _packed(runtime)
    assert (bound._native is None) == (runtime.libcuda.launch_address is None)  # the path asked
    x, y = torch.arange(8, dtype=torch.int32), torch.arange(16, dtype=torch.int32)
    assert [bound.value(i) for i in range(6)][1:] == [7, 9, 0.25, 1, None]
    bound.run((3, 2, 1), None, (y.data_ptr(), 11), (y, 11))
    (call,) = runtime.libcuda.calls
    assert (call["grid"], call["block"], call["shared"], call["stream"]) == ((3, 2, 1), (128, 1, 1), 96, 55)  # fmt: skip
    assert call["num_attrs"] == 0 and call["extra"] is None and call["function"] == 1234
    cells = call["cells"]
    assert len(cells) == 7  # five parameters (the constexpr is none) and two NULL pointers
    read = [_read(c, f) for c, f in zip(cells, ["<Q", "<i", "<i", "<f", "<B", "<Q", "<Q"], strict=True)]  # fmt: skip
    assert read == [y.data_ptr(), 11, 9, 0.25, 1, 0, 0]
    assert bound.args[:2] == [y, 11]  # the Python arguments follow the cells
    bound.set((x.data_ptr(), 2), (x, 2))  # then a relaunch on a given stream
    bound.launch((5, 1, 1), SimpleNamespace(cuda_stream=77))
    assert runtime.libcuda.calls[1]["grid"] == (5, 1, 1) and runtime.libcuda.calls[1]["stream"] == 77  # fmt: skip
    assert _read(runtime.libcuda.calls[1]["cells"][1], "<i") == 2 and bound.args[0] is x
    bound.run((3, 2, 1), None, (x.data_ptr(), 5), (x, 5))  # back to the first grid and stream
    bound.run((3, 2, 1), None, (y.data_ptr(), 6), (y, 6))  # the same again: the values alone
    for call, (ptr, value) in zip(runtime.libcuda.calls[2:], [(x.data_ptr(), 5), (y.data_ptr(), 6)], strict=True):  # fmt: skip
        assert (call["grid"], call["block"], call["stream"]) == ((3, 2, 1), (128, 1, 1), 55)
        assert (_read(call["cells"][0], "<Q"), _read(call["cells"][1], "<i")) == (ptr, value)
    with pytest.raises(OverflowError):
        bound.set((x.data_ptr(), 2**31), (x, 2**31))  # another specialization: a new bind


def test_a_refused_launch_raises_with_the_drivers_error_name(runtime, monkeypatch):
    bound = _packed(runtime)
    monkeypatch.setattr(runtime.libcuda, "launch", lambda *args: 700)
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx: error 700"):
        bound.launch((1, 1, 1))


@pytest.mark.parametrize("method", ["run", "launch"])  # launch tests the usual case inline
@pytest.mark.parametrize("case", ["enter hook", "exit callable", "other device", "other context"])
def test_packed_launches_take_tritons_launch_when_a_call_needs_it(runtime, case, method):
    kernel = RecordingJIT(_body)
    bound = _packed(runtime, kernel)
    if case == "enter hook":  # a profiler registers a hook
        runtime.knobs.launch_enter_hook.add(print)
    elif case == "exit callable":
        runtime.knobs.launch_exit_hook = print
    elif case == "other device":
        runtime.device[0] = 1
    else:  # another thread whose current context is not the kernel's
        runtime.libcuda.context = 2
    words = torch.arange(4, dtype=torch.int32)
    run = lambda: bound.run((2, 1, 1), None, (words.data_ptr(), 3), (words, 3))  # noqa: E731
    if method == "launch":
        bound.set((words.data_ptr(), 3), (words, 3))
        run = lambda: bound.launch((2, 1, 1))  # noqa: E731
    if case == "other context":
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    else:
        run()
    assert runtime.libcuda.calls == [] and _paths(kernel) == ["triton"]
    assert kernel.log[0][3][:2] == (words, 3)  # Triton's launch got the new arguments


def test_a_launch_through_tritons_leaves_no_stream_handle(runtime):
    # stream_handle is the stream of the last launch through the driver (the MLA memo skips its
    # capture query on handle 0): after a launch through Triton's it must not stay set
    kernel = RecordingJIT(_body)
    bound = _packed(runtime, kernel)
    words = torch.arange(4, dtype=torch.int32)
    assert bound.stream_handle is None
    bound.run((2, 1, 1), None, (words.data_ptr(), 3), (words, 3))
    assert bound.stream_handle is not None and bound.stream_handle == runtime.libcuda.calls[-1]["stream"]  # fmt: skip
    runtime.knobs.launch_enter_hook.add(print)
    bound.run((2, 1, 1), None, (words.data_ptr(), 3), (words, 3))
    assert bound.stream_handle is None and _paths(kernel)[-1] == "triton"


def test_the_c_driver_call_can_be_turned_off(monkeypatch):
    _native.c_module.cache_clear()
    native.checked_data_ptrs.cache_clear()
    monkeypatch.setenv("KVMGR_NATIVE_LAUNCH", "0")
    try:
        assert native.native_fire() is None
        read = native.checked_data_ptrs()
        assert read is _native._python_checked_ptrs  # the same values, from Python
        words = torch.empty(4, dtype=torch.int32)
        guard = tensor_guard((words, words[1:]))
        assert read(guard.check, words, words[1:]) == (words.data_ptr(), words.data_ptr() + 4)
        assert read(guard.check, words, words) is None
    finally:
        monkeypatch.undo()
        _native.c_module.cache_clear()
        native.checked_data_ptrs.cache_clear()


def test_checked_data_ptrs_reads_only_what_the_guard_accepts():
    # the pointers of the tensors a tensor guard accepts, in one call; None where it refuses:
    # another shape, stride, dtype, or a tensor without storage (whose pointer read would end
    # the process from C), which the guard's dispatch keys refuse first
    read = native.checked_data_ptrs()
    words = torch.empty(64, dtype=torch.int32)
    tensors = (
        words,
        words[5:],
        words.view(torch.float16)[3:],
        words.view(8, 8).t(),
        torch.empty(0),
    )
    guard = tensor_guard(tensors)
    assert read(guard.check, *tensors) == tuple(t.data_ptr() for t in tensors)
    more = torch.empty(64, dtype=torch.int32)  # the same layouts in other memory
    others = (more, more[5:], more.view(torch.float16)[3:], more.view(8, 8).t(), torch.empty(0))
    assert read(guard.check, *others) == tuple(t.data_ptr() for t in others)
    with warnings.catch_warnings():  # torch 2.11 warns that its invariant checks are off
        warnings.simplefilter("ignore", UserWarning)
        sparse = torch.sparse_coo_tensor(
            torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (4,), check_invariants=True
        )
    one = tensor_guard((torch.empty(4),))
    for bad in (words[:10], words.view(torch.float32), words.view(8, 8), sparse):
        assert read(one.check, bad) is None
    with pytest.raises(TypeError):  # another number of tensors: the guard's own error
        read(guard.check, words)
    if read is not _native._python_checked_ptrs:  # the C function checks its arguments' type
        for bad in (None, 3, words.numpy()):
            with pytest.raises(TypeError, match="not a tensor"):
                read(lambda *args: True, words, bad)
        assert read(lambda *args: False, None) is None  # a refusal reads nothing


def test_the_cell_writer_writes_only_what_the_guard_and_the_known_pointers_accept():
    # write(cells.address, check, *tensors): the verdict, the known tensors' pointers, the two
    # bases' alignment; only then every other pointer to its cell and every word to its address
    write = cell_writer()
    if write is None:
        pytest.skip("the C module cannot be built here (no C compiler?)")
    words = torch.empty(64, dtype=torch.int32)
    known, kv, pe, slots = words[:4], words[8:24], words[24:40], words[40:56]
    out = (ctypes.c_uint64 * 4)()
    base = ctypes.addressof(out)
    tensors = (known, kv, pe, slots)
    cells = StepCells([known.data_ptr()], True, [base, base + 8, base + 16], [(base + 24, 77)], out)
    guard = tensor_guard(tensors)
    refusals = [
        (guard.check, (words[4:8],), kv, pe, slots),  # another known pointer
        (guard.check, (known,), words[9:25], pe, slots),  # kv 4 bytes past 16-byte alignment
        (guard.check, (known,), kv.view(torch.float32), pe, slots),  # the guard refuses
        (guard.check, (known,), kv, pe),  # another number of tensors
        (guard.check, (), known, kv, pe, slots),  # another number of known tensors
        (lambda *args: False, [known], kv, pe, slots),
    ]
    for args in refusals:
        assert write(cells.address, *args) is None
        assert list(out) == [0, 0, 0, 0]  # nothing written
    with pytest.raises(TypeError, match="not a tensor"):
        write(cells.address, lambda *args: True, (known,), kv, pe, None)
    with pytest.raises(TypeError, match="tuple or list"):
        write(cells.address, guard.check, known, kv, pe, slots)
    assert list(out) == [0, 0, 0, 0]
    assert write(cells.address, guard.check, [known], kv, pe, slots) == (kv.data_ptr(), pe.data_ptr(), slots.data_ptr())  # fmt: skip
    assert list(out) == [kv.data_ptr(), pe.data_ptr(), slots.data_ptr(), 77]
    unaligned = StepCells([], False, [base, base + 8], [], out)
    odd = (words[1:9], words[2:10])
    assert write(unaligned.address, tensor_guard(odd).check, (), *odd) == tuple(t.data_ptr() for t in odd)  # fmt: skip
    assert write(unaligned.address, tensor_guard((kv, pe)).check, (), kv, pe) is None  # aligned


def test_a_new_thread_with_the_kernels_context_is_adopted(runtime):
    bound = _packed(runtime)
    thread = threading.Thread(target=lambda: bound.launch((1, 1, 1)))
    thread.start()
    thread.join()
    assert len(runtime.libcuda.calls) == 1


def test_param_types_and_ptx_sizes():
    assert signature.ptx_param_sizes(_PTX) == [8, 4, 4, 4, 1, 8, 8]
    assert signature.ptx_param_sizes("no entry here") is None
    compiled = {"a": "*bf16", "b": "i64", "c": "constexpr", "d": "u1"}
    assert signature.param_ctypes(compiled, ["a", "b", "c", "d"]) == ["*bf16", "i64", None, "u1"]
    assert signature.param_ctypes(compiled, ["a", "b", "d", "c"]) is None  # another order
    assert signature.param_ctypes({"a": "nvTmaDesc"}, ["a"]) is None  # not packed


@pytest.mark.parametrize("case", ["global_scratch", "profile_scratch", "clusters", "pdl", "ptx_differs", "names"])  # fmt: skip
def test_packing_declines_what_it_cannot_launch(case):
    meta = {"global_scratch": {"global_scratch_size": 64}, "profile_scratch": {"profile_scratch_size": 8},
            "clusters": {"num_ctas": 2}, "pdl": {"launch_pdl": True}}.get(case, {})  # fmt: skip
    compiled = FakeCompiled()
    for name, value in meta.items():
        setattr(compiled.metadata, name, value)
    names = list(_BODY_SIGNATURE)
    if case == "ptx_differs":
        compiled.asm["ptx"] = _PTX.replace(".param .u32 k_param_1", ".param .u64 k_param_1")
    if case == "names":
        names = ["n", "x_ptr", *names[2:]]
    assert signature.packing_of(FakeCompiled(), list(_BODY_SIGNATURE)) is not None
    assert signature.packing_of(compiled, names) is None


# --- an owner's launches ---------------------------------------------------------------------


def test_launches_bind_once_per_class_and_drop_the_oldest(runtime):
    kernel = RecordingJIT(_body)
    launches = Launches(kernel, tuple(range(6)), num_warps=2, max_bound=3)  # every argument varies
    words = torch.arange(64, dtype=torch.int32)
    for n in (5, 7, 16, 32, 1, 5):  # classes: plain, plain, %16, %16, ==1, plain
        launches((1, 1, 1), None, words, n, 3, 1.0, True, 0)
    assert launches.num_bound == 3 and _paths(kernel).count("warmup") == 3
    assert [_read(c["cells"][1], "<i") for c in runtime.libcuda.calls] == [5, 7, 16, 32, 1, 5]
    launches((1, 1, 1), None, words[1:], 5, 3, 1.0, True, 0)  # misaligned: a fourth class
    assert launches.num_bound == 3  # the oldest (plain ints) was dropped
    assert launches.get(launches.read(words, 5, 3, 1.0, True, 0)[0]) is None
    assert all(c["block"] == (128, 1, 1) for c in runtime.libcuda.calls)  # FakeCompiled: 4 warps


# --- Triton's real compile behind a stub driver and a fake libcuda (CPU only) ----------------

_STUB_RUN = textwrap.dedent(
    """
    import json, os, struct, sys
    import torch

    sys.path.insert(0, os.getcwd())
    from kvmgr.bench import stub_gpu
    seen = stub_gpu.install(record=True)
    from kvmgr.hooks import StepContext
    from kvmgr.kernels.c128 import kernel as c128_kernel
    from kvmgr.kernels.c128.hook import C128CompressorHook
    from kvmgr.kernels.c128.layout import c128_entry_bytes
    from kvmgr.kernels.launch import launcher as launcher_module, shared_launcher
    from kvmgr.kernels.mla import kernel as mla_kernel
    from kvmgr.kernels.mla.hook import GroupedMLAInsertHook

    def read(cell, expected):  # a cell's bytes: small ints are i32 cells, addresses u64 cells
        fmt = "<f" if isinstance(expected, float) else "<i" if expected < 2**20 else "<Q"
        return struct.unpack_from(fmt, cell)[0]

    gen = torch.Generator().manual_seed(0)
    D, S = 128, 8
    layer = dict(state_cache=torch.randn(8, S, 2 * D, generator=gen),
                 compressed_cache=torch.zeros(8, 4, c128_entry_bytes(D), dtype=torch.uint8),
                 ape=torch.randn(128, D, generator=gen), norm_weight=torch.rand(D, generator=gen),
                 cos_sin_cache=torch.rand(512, 64, generator=gen))
    hook = C128CompressorHook(**layer, gated=False, eps=0.5)
    caches = [torch.zeros(4, 16, 96, dtype=torch.float8_e4m3fn) for _ in range(3)]
    scales = torch.ones(3)
    mla = GroupedMLAInsertHook(caches, kv_cache_dtype="fp8_e4m3", kv_scales=scales, validate=False)
    expected = []
    for num_tokens in (1, 5, 9, 30):  # every step size: the same compiled kernels after the first
        pos = torch.arange(120, 120 + num_tokens)
        table = torch.arange(24, dtype=torch.int32).view(3, 8)
        t = {"positions": pos, "c128.state_slot_mapping": pos % 64, "c128.state_block_table": table,
             "c128.req_indices": torch.zeros(num_tokens, dtype=torch.int32),
             "c128.slot_mapping": torch.arange(num_tokens),
             "c128.kv": torch.randn(num_tokens, D, generator=gen),
             "c128.score": torch.randn(num_tokens, D, generator=gen)}
        hook(StepContext(tensors=t))
        kv_c = torch.randn(3, num_tokens, 64, generator=gen)
        k_pe = torch.randn(3, num_tokens, 32, generator=gen)
        slots = torch.arange(num_tokens).repeat(3, 1)  # [L, T] slots
        mla(StepContext(tensors={"kv_c": kv_c, "k_pe": k_pe, "slot_mapping": slots}))
        lay = hook._layer
        expected.append([t["c128.kv"].data_ptr(), t["c128.score"].data_ptr(), lay.ape.data_ptr(),
                         pos.data_ptr(), t["c128.state_slot_mapping"].data_ptr(),
                         lay.state_cache.data_ptr(), D, D, 8 * 2 * D, 2 * D, 64, 0, 0])
        expected.append([lay.state_cache.data_ptr(), table.data_ptr(),
                         t["c128.req_indices"].data_ptr(), pos.data_ptr(),
                         t["c128.slot_mapping"].data_ptr(), lay.norm_weight.data_ptr(),
                         lay.cos_sin_cache.data_ptr(), lay.compressed_cache.data_ptr(), 8 * 2 * D,
                         2 * D, 8, 0.5, 3, 8, 8, 512, 32, 0, 0])
        expected.append([kv_c.data_ptr(), k_pe.data_ptr(), mla.plan.table.data_ptr(),
                         slots.data_ptr(), scales.data_ptr(), num_tokens, kv_c.stride(0),
                         k_pe.stride(0), slots.stride(0), 0, 0])
    launchers = [shared_launcher(c128_kernel.state_write_kernel),
                 shared_launcher(c128_kernel.compress_kernel),
                 shared_launcher(mla_kernel.grouped_insert_kernel)]
    print(json.dumps({
        "runtime": launcher_module._direct_runtime() is not None,
        "direct": [lau.direct for lau in launchers],
        "compiled": [lau.num_compiled for lau in launchers],
        "packed": [b.is_packed for b in [*mla._insert.bound(), *hook._layer._write.bound(),
                                         *hook._layer._compress.bound()]],
        "triton_launches": seen.triton_launches, "jit_launches": seen.jit_launches,
        "expected": expected,
        "calls": [{**c, "params": [read(a, e) for a, e in zip(c["params"], exp)],
                   "num_params": len(c["params"])} for c, exp in zip(seen.calls, expected)],
    }))
    """
)


@pytest.fixture(scope="module")
def stub_run(tmp_path_factory) -> dict[str, object]:
    """The hooks' kernels compiled by Triton (sm_90) and launched through a recording stand-in
    of libcuda (:mod:`kvmgr.bench.stub_gpu`), in a subprocess (the stand-in stays installed)."""
    if torch.cuda.is_available():
        pytest.skip("the gpu tests launch for real")
    script = tmp_path_factory.mktemp("stub") / "stub_run.py"
    script.write_text(_STUB_RUN)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_real_compile_one_specialization_per_kernel_every_launch_packed(stub_run):
    # Triton's own warmup and CompiledKernel (sm_90) for both hooks; every launch goes through
    # cuLaunchKernelEx from packed arguments: none through JITFunction.run or Triton's launcher
    assert stub_run["runtime"] and stub_run["direct"] == [True, True, True]
    assert stub_run["compiled"] == [1, 1, 1]  # one key per kernel for every step size
    assert stub_run["packed"] == [True, True, True]  # one bound launch each, packed
    assert stub_run["jit_launches"] == [] and stub_run["triton_launches"] == []
    calls = stub_run["calls"]
    assert len(calls) == 4 * 3 and all(c["stream"] == 7 for c in calls)
    grids = [c["grid"] for c in calls]
    assert grids[2::3] == [[1, 3, 1], [5, 3, 1], [9, 3, 1], [30, 3, 1]]  # MLA: (tiles, L, 1)
    assert grids[0::3] == grids[1::3] == [[1, 1, 1], [5, 1, 1], [9, 1, 1], [30, 1, 1]]


def test_real_compile_packed_cells_hold_each_steps_arguments(stub_run):
    # every cell holds the expected pointer or int, in the PTX .entry order, plus the two NULL
    # scratch pointers; no launch attributes, no extra
    for call, want in zip(stub_run["calls"], stub_run["expected"], strict=True):
        assert call["num_params"] == len(want) and call["attrs"] == [0, 0]
        assert call["params"][:-1] == pytest.approx(want[:-1]) and call["params"][-1] == 0
        assert call["extra"] is None and call["function"] == 1
    assert stub_run["calls"][2]["block"] == [64, 1, 1] and stub_run["calls"][1]["block"] == [128, 1, 1]  # fmt: skip


def test_bench_launch_host_runs_every_row_packed_on_the_stand_in(tmp_path):
    # kvmgr bench launch-host: every MLA and c128 row measured through packed launches (a row
    # on Triton's launch would measure the wrong path)
    if torch.cuda.is_available():
        pytest.skip("the gpu tests launch for real")
    out = tmp_path / "launch_host.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    argv = ["--tokens", "1", "--sets", "2", "--calls", "4", "--rounds", "1", "--json", str(out)]
    done = subprocess.run([sys.executable, "-m", "kvmgr.cli", "bench", "launch-host", *argv],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    launch_rows = [r for r in rows if "alone" not in r["row"] and "(in every" not in r["row"]]
    floor = 3 if native.native_fire() is not None else 2  # the C call's row where it builds
    assert len(rows) == 6 + 5 + floor and len(launch_rows) == 10
    assert all(r["packed"] and 0 < r["min_us"] <= r["median_us"] for r in launch_rows)


# --- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_packed_launches_are_enabled_here():
    # on the NVIDIA machine every check must pass; a silent fallback would void the benchmarks
    assert launcher_module._direct_runtime() is not None and libcuda.driver() is not None
    launcher = Launcher(_scale_kernel)
    x = torch.randn(100, device="cuda")
    out = torch.empty_like(x)
    bound = launcher.bind((1, 1, 1), x, out, 100, 2.0, 128, num_warps=4)
    assert bound.is_packed, "packing fell back on the GPU"
    bound.launch((1, 1, 1))
    torch.cuda.synchronize()
    assert launcher.direct and launcher.num_compiled == 1
    assert torch.equal(out, x * 2.0 + 100)


@pytest.mark.gpu
def test_gpu_packed_matches_tritons_launch_on_streams_and_in_graphs():
    # updated values give the new step's result (n is not specialized: any value stays within
    # the compiled specialization), on a given stream and under capture
    kernel = triton.jit(_scale_kernel.fn, do_not_specialize=["n"])
    launches = Launches(kernel, tuple(range(5)), num_warps=4)  # every argument varies
    gen = torch.Generator(device="cuda").manual_seed(9)
    storage = torch.randn(4099, device="cuda", generator=gen)
    for offset, n in [(0, 4096), (1, 4097), (0, 17), (3, 16), (0, 4096)]:  # alignment and ints
        x = storage[offset : offset + n]
        ours, theirs = (torch.full_like(x, float("nan")) for _ in range(2))
        launches((triton.cdiv(n, 256), 1, 1), None, x, ours, n, 0.25, 256)
        _scale_kernel[(triton.cdiv(n, 256),)](x, theirs, n, 0.25, BLOCK=256, num_warps=4)
        torch.cuda.synchronize()
        assert torch.equal(ours, theirs) and torch.equal(ours, x * 0.25 + n)
    assert launches.num_bound == 2 and all(b.is_packed for b in launches.bound())  # alignment
    x, out = storage[:4096], torch.empty(4096, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    launches((16, 1, 1), side, x, out, 4096, 2.0, 256)
    side.synchronize()
    assert torch.equal(out, x * 2.0 + 4096)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches((16, 1, 1), None, x, out, 4096, 4.0, 256)
    classes, values = launches.read(x, out, 1, 4.0, 256)  # a later write leaves the capture alone
    launches.get(classes).set(values, (x, out, 1, 4.0, 256))
    for seed in (10, 11):
        x.copy_(torch.randn(4096, device="cuda", generator=gen.manual_seed(seed)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x * 4.0 + 4096)


# --- layout ----------------------------------------------------------------------------------


def _import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> kvmgr modules it imports (module level and inside functions), from the AST."""
    import ast

    root = package_dir.parents[len(package_dir.relative_to(ROOT).parts) - 1]
    modules = {}
    for path in package_dir.rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_kernels_have_no_import_cycles_and_families_use_only_the_launch_package():
    graph = _import_graph(ROOT / "kvmgr" / "kernels")
    assert "kvmgr.kernels.mla.kernel" in graph["kvmgr.kernels.mla.plan"]  # the graph is read
    assert "kvmgr.kernels.launch" in graph["kvmgr.kernels.c128.host"]
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]  # the finder finds
    families = {name.split(".")[2] for name in graph if name.count(".") >= 3}
    assert families == {"launch", "copy", "mla", "c128"}  # every module lives in a family
    for name, targets in graph.items():
        family = name.split(".")[2] if name.count(".") >= 2 else None
        for target in targets:
            other = target.split(".")[2] if target.count(".") >= 2 else None
            # a family imports itself and the launch package; the launch package no family
            assert other in (None, family, "launch") or family is None, (name, target)
        if name.endswith(".reference"):  # references import no kernel, host or launcher
            assert not any(t.rsplit(".", 1)[-1] in {"kernel", "host", "api"} for t in targets)


def test_one_launch_mechanism_one_rule_one_owner_per_cache():
    # the loose launcher modules are gone; only the launch package generates specialization
    # code; the MLA insert's caches have one owner each (no module-level memo but the memo)
    import ast

    kernels = ROOT / "kvmgr" / "kernels"
    assert not any((kernels / name).exists() for name in ("launch.py", "packed_launch.py", "table_launch.py"))  # fmt: skip
    # a copy of the rule: the int classes (== 1, % 16) side by side, or generated key code
    pattern = re.compile(r"== 1\b.{0,40}(% 16 == 0|& 15 == 0)|exec\(compile\(")
    rules = [p for p in kernels.rglob("*.py") if pattern.search(p.read_text())]
    assert sorted(p.relative_to(kernels).as_posix() for p in rules) == ["launch/rule.py"]
    containers = ("list", "dict", "set", "OrderedDict", "defaultdict")
    for path in (kernels / "mla").glob("*.py"):
        tree = ast.parse(path.read_text())
        memos = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                 and node.attr in ("cache", "lru_cache")]  # fmt: skip
        assert memos == [], path.name
        values = [node.value for node in tree.body if isinstance(node, ast.Assign)]
        empty = [v for v in values if isinstance(v, ast.List | ast.Set) and not v.elts]
        empty += [v for v in values if isinstance(v, ast.Dict) and not v.keys]
        empty += [v for v in values if isinstance(v, ast.Call) and getattr(v.func, "id", "") in containers]  # fmt: skip
        assert empty == [], path.name  # no module-level container to fill at run time
    from kvmgr.kernels.mla import api, memo

    assert isinstance(api._MEMO, memo.InsertMemo)  # the function's one owner of its cache sets
