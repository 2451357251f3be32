"""DirectLauncher: its cache key against Triton's own specialization, its fallbacks, the interpreter.

The key tests build real ``JITFunction`` objects (no GPU needed) and compare the key with
Triton's ``native_specialize_impl``. Launch paths use a recording ``JITFunction`` subclass and a
fake runtime; one test runs Triton's real compile (sm_90) behind a stub driver in a subprocess,
and the ``gpu`` tests launch for real, eagerly and inside a CUDA graph.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
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
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from kvmgr.kernels import launch as _launch
from kvmgr.kernels.launch import DirectLauncher

ROOT = Path(__file__).resolve().parents[1]


def _body(x_ptr, n, m, f, b, FLAG: tl.constexpr):  # type: ignore[no-untyped-def]
    pass  # never compiled: the key and launch-path tests only need the signature


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale + n, mask=mask)


def _launcher(monkeypatch: pytest.MonkeyPatch, kernel: object) -> DirectLauncher:
    """A launcher built with the interpreter off (conftest turns it on without a GPU)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return DirectLauncher(kernel)


def _key(launcher: DirectLauncher, *args: object) -> tuple[object, ...]:
    assert launcher._key is not None
    return launcher._key("head", args)


# --- the key ---------------------------------------------------------------------------------


def test_key_separates_what_triton_specializes_on(monkeypatch):
    launcher = _launcher(monkeypatch, JITFunction(_body, do_not_specialize=["m"]))
    words = torch.arange(64, dtype=torch.int32)
    base = (words, 17, 17, 0.5, True, 3)
    same = [  # another call that must hit the same compiled kernel
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
    assert all(_key(launcher, *args) == _key(launcher, *base) for args in same)
    keys = [_key(launcher, *args) for args in [base, *different]]
    assert len(set(keys)) == len(keys)


def test_do_not_specialize_pointers_ignore_alignment(monkeypatch):
    launcher = _launcher(monkeypatch, JITFunction(_body, do_not_specialize=["x_ptr"]))
    words = torch.arange(8, dtype=torch.int32)
    assert _key(launcher, words, 3, 3, 1.0, True, 0) == _key(
        launcher, words[1:], 3, 3, 1.0, True, 0
    )
    assert _key(launcher, words, 3, 3, 1.0, True, 0) != _key(launcher, words.half(), 3, 3, 1.0, True, 0)  # fmt: skip


_BACKEND = make_backend(GPUTarget("cuda", 90, 32))


_TENSOR = st.tuples(st.sampled_from([torch.int16, torch.float32]), st.integers(0, 7))
_ARG = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.integers(-70, 70),
    st.sampled_from([2**31 - 16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 16, 2**63]),
    st.booleans(),
    st.floats(allow_nan=False),
    st.none(),
    _TENSOR,  # (dtype, element offset) into one buffer: aligned or not
)


@settings(max_examples=500, deadline=None)
@given(_ARG, _ARG, st.booleans(), st.booleans())
def test_equal_keys_mean_equal_triton_specialization(first, second, specialize, align):
    # the key may be finer than Triton's specialization, never coarser: whenever two arguments
    # share a key, Triton's own rule (the one its per-kernel binder calls) agrees on them
    buffer = torch.zeros(64, dtype=torch.uint8)
    args = [buffer.view(a[0])[a[1] :] if isinstance(a, tuple) else a for a in (first, second)]
    key = _launch._key_function((_launch._SPECIALIZED if specialize else _launch._PLAIN,))
    ours = [key(None, (a,)) for a in args]
    theirs = [native_specialize_impl(_BACKEND, a, False, specialize, align) for a in args]
    if ours[0] == ours[1]:
        assert theirs[0] == theirs[1]


def test_rule_probe_accepts_this_triton_and_rejects_another_rule():
    assert _launch._rules_agree(native_specialize_impl, _BACKEND)

    def divisible_by_eight(backend, arg, is_const, specialize, align):  # a hypothetical Triton
        kind, attr = native_specialize_impl(backend, arg, is_const, specialize, align)
        if type(arg) is int and specialize and arg % 8 == 0:
            attr = (attr or "") + "D8"
        return kind, attr

    assert not _launch._rules_agree(divisible_by_eight, _BACKEND)


# --- launch paths, against a fake runtime ----------------------------------------------------


class FakeCompiled:
    """A ``CompiledKernel`` as the direct launch uses it; ``run`` logs, or raises when ``fail``."""

    function, packed_metadata = "function", "packed"

    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail

    def launch_metadata(self, grid, stream, *args):
        return ("meta", grid)

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, leave, *args):
        if self.fail:
            raise TypeError("launcher signature differs")
        self.log.append(
            ("direct", (g0, g1, g2), stream, (function, packed, meta, enter, leave), args)
        )


class RecordingJIT(JITFunction):
    """A real ``JITFunction`` whose normal launch and ``warmup`` record instead of compiling."""

    def __init__(self, fn, compiled=FakeCompiled, **kw):
        super().__init__(fn, **kw)
        self.log, self.make_compiled = [], compiled

    def __getitem__(self, grid):
        return lambda *args, **options: self.log.append(("normal", grid, options, args))

    def warmup(self, *args, grid, **options):
        self.log.append(("warmup", grid, options, args))
        return self.make_compiled(self.log)


@pytest.fixture
def runtime(monkeypatch):
    """A fake process runtime (device 0, stream "s<device>") in place of Triton's driver."""
    device = [0]
    knobs = SimpleNamespace(debug=False, override_arch=None, launch_enter_hook="enter",
                            launch_exit_hook="exit", add_stages_inspection_hook=None)  # fmt: skip
    fake = _launch._Runtime(lambda: device[0], lambda dev: f"s{dev}", knobs,
                            SimpleNamespace(instrumentation_mode=""),
                            SimpleNamespace(default_fp_fusion=True), FakeCompiled)  # fmt: skip
    monkeypatch.setattr(_launch, "_direct_runtime", lambda: fake)
    return SimpleNamespace(device=device, knobs=knobs)


def _paths(kernel: RecordingJIT) -> list[str]:
    return [entry[0] for entry in kernel.log]


def test_each_new_key_compiles_once_then_launches_directly(monkeypatch, runtime):
    kernel = RecordingJIT(_body, do_not_specialize=["m"])
    launcher = _launcher(monkeypatch, kernel)
    aligned = torch.arange(8, dtype=torch.int32)
    shifted = torch.arange(9, dtype=torch.int32)[1:]  # 4 bytes past a 16-byte boundary
    steps = [  # (args, new key?)
        ((aligned, 16, 5, 1.0, True, 7), True), ((aligned, 16, 6, 2.0, False, 7), False),
        ((shifted, 16, 5, 1.0, True, 7), True), ((shifted, 32, 5, 1.0, True, 7), False),
        ((aligned.long(), 16, 5, 1.0, True, 7), True), ((aligned, 17, 5, 1.0, True, 7), True),
        ((aligned, 1, 5, 1.0, True, 7), True), ((aligned, 16, 5, 1.0, True, 8), True),
        ((aligned, 16, 5, 1.0, True, 7), False),
    ]  # fmt: skip
    expected = []
    for args, is_new in steps:
        launcher((3,), *args, num_warps=4)
        expected += ["warmup", "direct"] if is_new else ["direct"]
    runtime.knobs.debug = True  # a knob that enters Triton's compile options
    launcher((3,), *steps[0][0], num_warps=4)
    runtime.device[0] = 1  # a kernel compiled for device 0 is not launched on device 1
    launcher((3, 2), *steps[0][0], num_warps=4)
    launcher((3, 2), *steps[0][0], num_warps=8)  # nor with other launch options
    assert _paths(kernel) == [*expected, *["warmup", "direct"] * 3]
    assert launcher.direct and launcher.num_compiled == 9
    # the direct launch is the call JITFunction.run makes: 3-D grid, the device's stream, the
    # compiled function and metadata, the launch hooks, then every argument in order
    _, grid, stream, launch, args = kernel.log[-1]
    assert (grid, stream) == ((3, 2, 1), "s1")
    assert launch == ("function", "packed", ("meta", (3, 2)), "enter", "exit")
    assert args == steps[0][0]
    assert kernel.log[-2][1:3] == ((3, 2), {"num_warps": 8})  # warmup got the grid and options


def test_empty_launch_hook_chains_are_passed_as_none(monkeypatch, runtime):
    # Triton's default hooks are empty HookChains; the launcher skips None hooks just as it
    # skips empty chains, and only hooks read the launch metadata, so it is built only for them
    from triton.knobs import HookChain

    kernel = RecordingJIT(_body)
    launcher = _launcher(monkeypatch, kernel)
    runtime.knobs.launch_enter_hook, runtime.knobs.launch_exit_hook = HookChain(), HookChain()
    words = torch.arange(8, dtype=torch.int32)
    launcher((1,), words, 3, 3, 1.0, True, 0)
    assert kernel.log[-1][3] == ("function", "packed", None, None, None)
    runtime.knobs.launch_exit_hook.add(print)  # a profiler registers a hook
    launcher((1,), words, 3, 3, 1.0, True, 0)
    assert kernel.log[-1][3] == ("function", "packed", ("meta", (1,)), None, runtime.knobs.launch_exit_hook)  # fmt: skip
    assert _paths(kernel) == ["warmup", "direct", "direct"]


@pytest.mark.parametrize("internal", ["no runtime", "warmup result", "globals", "launch raises"])
def test_fallback_is_permanent_when_internals_differ(monkeypatch, runtime, internal):
    kernel = RecordingJIT(_body, compiled={
        "warmup result": lambda log: object(),
        "launch raises": lambda log: FakeCompiled(log, fail=True),
    }.get(internal, FakeCompiled))  # fmt: skip
    if internal == "no runtime":  # not CUDA, another Triton, or a rule probe that disagreed
        monkeypatch.setattr(_launch, "_direct_runtime", lambda: None)
    if internal == "globals":  # JITFunction.run re-checks globals on every call; we would not
        kernel.used_global_vals = {("G", 0): (1, {})}
    launcher = _launcher(monkeypatch, kernel)
    words = torch.arange(8, dtype=torch.int32)
    for _ in range(3):
        launcher((2,), words, 3, 3, 1.0, True, 0, num_stages=2)
    compiled_once = ["warmup"] if internal != "no runtime" else []
    assert _paths(kernel) == [*compiled_once, "normal", "normal", "normal"]
    assert kernel.log[-1][1:3] == ((2,), {"num_stages": 2})  # the caller's grid and options
    assert not launcher.direct and launcher.num_compiled == 0


@pytest.mark.parametrize("case", ["pre-run hook", "stages hook", "numpy int", "keyword count"])
def test_some_calls_take_the_normal_launch_and_direct_stays_on(monkeypatch, runtime, case):
    kernel = RecordingJIT(_body)
    launcher = _launcher(monkeypatch, kernel)
    words = torch.arange(8, dtype=torch.int32)
    args: tuple[object, ...] = (words, 3, 3, 1.0, True, 0)
    if case == "pre-run hook":
        kernel.add_pre_run_hook(lambda *a, **k: None)
    elif case == "stages hook":
        runtime.knobs.add_stages_inspection_hook = lambda: ("key", "hash")
    elif case == "numpy int":
        args = (words, np.int64(3), 3, 1.0, True, 0)
    else:  # a parameter left to its default or passed by keyword: not every one positional
        args = (words, 3, 3, 1.0, True)
    launcher((2,), *args)
    assert _paths(kernel) == ["normal"] and launcher.direct


def test_interpreter_and_opt_out_always_take_the_normal_launch(monkeypatch):
    # under TRITON_INTERPRET=1 the decorator gives an InterpretedFunction; a hand-made
    # JITFunction is refused too while the variable is set
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = InterpretedFunction(_scale_kernel.fn)
    assert not DirectLauncher(interpreted).direct
    assert not DirectLauncher(JITFunction(_body)).direct
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not DirectLauncher(JITFunction(_body), direct=False).direct
    assert not DirectLauncher(object()).direct  # a test double
    # and the interpreted kernel really runs through the launcher
    x = torch.randn(37, generator=torch.Generator().manual_seed(3))
    out = torch.full_like(x, float("nan"))
    DirectLauncher(interpreted)((3,), x, out, 37, 0.5, 16, num_warps=1)
    assert torch.equal(out, x * 0.5 + 37)


def test_shared_launcher_is_one_per_kernel_and_mode():
    kernel = object()
    assert _launch.shared_launcher(kernel) is _launch.shared_launcher(kernel, True)
    assert _launch.shared_launcher(kernel, False) is not _launch.shared_launcher(kernel)


# --- Triton's real compile behind a stub driver (CPU only) -----------------------------------

_STUB_DRIVER_RUN = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import GPUDriver
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    launches, jit_launches = [], []

    class Launcher:  # Triton's C launcher, minus the driver call: checks the argument count
        def __init__(self, src, metadata):
            self.num_params = len(src.signature)
        def __call__(self, gx, gy, gz, stream, function, packed, meta, enter, leave, *args):
            assert len(args) == self.num_params, (len(args), self.num_params)
            launches.append([gx, gy, gz, stream])

    class Utils:
        def load_binary(self, name, kernel, shared, device):
            return (1, 1, 32, 0, 1024)
        def get_device_properties(self, device):
            return {"max_shared_mem": 232448, "multiprocessor_count": 132,
                    "max_num_regs": 65536, "warpSize": 32}

    class StubDriver(GPUDriver):
        def __init__(self):
            self.get_current_device = lambda: 0
            self.get_current_stream = lambda device=0: 7
            self.set_current_device = lambda device: None
            self.utils, self.launcher_cls = Utils(), Launcher
        @staticmethod
        def is_active():
            return True
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)
        def get_active_torch_device(self):
            return torch.device("cpu")
        def map_python_to_cpp_type(self, ty):
            return ty
        def get_benchmarker(self):
            raise NotImplementedError
        def get_device_interface(self):
            return torch.cuda

    driver.set_active(StubDriver())
    run = JITFunction.run
    def counting_run(self, *args, grid, warmup, **kw):
        if not warmup:
            jit_launches.append(self.fn.__name__)
        return run(self, *args, grid=grid, warmup=warmup, **kw)
    JITFunction.run = counting_run

    sys.path.insert(0, os.getcwd())
    from kvmgr.hooks import StepContext
    from kvmgr.kernels import launch as _launch
    from kvmgr.kernels.c128 import kernel as c128_kernel
    from kvmgr.kernels.c128.hook import C128CompressorHook
    from kvmgr.kernels.c128.layout import c128_entry_bytes
    from kvmgr.kernels.mla import host as mla_host
    from kvmgr.kernels.mla.hook import GroupedMLAInsertHook

    gen = torch.Generator().manual_seed(0)
    D, S = 128, 8
    hook = C128CompressorHook(
        state_cache=torch.randn(8, S, 2 * D, generator=gen),
        compressed_cache=torch.zeros(8, 4, c128_entry_bytes(D), dtype=torch.uint8),
        ape=torch.randn(128, D, generator=gen), norm_weight=torch.rand(D, generator=gen),
        cos_sin_cache=torch.rand(512, 64, generator=gen), gated=False)
    def c128_step(num_tokens):
        pos = torch.arange(120, 120 + num_tokens)
        tensors = {"positions": pos, "c128.state_slot_mapping": pos % 64,
                   "c128.state_block_table": torch.arange(8, dtype=torch.int32).view(1, 8),
                   "c128.req_indices": torch.zeros(num_tokens, dtype=torch.int32),
                   "c128.slot_mapping": torch.arange(num_tokens),
                   "c128.kv": torch.randn(num_tokens, D, generator=gen),
                   "c128.score": torch.randn(num_tokens, D, generator=gen)}
        return StepContext(tensors=tensors)
    caches = [torch.zeros(4, 16, 96, dtype=torch.float8_e4m3fn) for _ in range(3)]
    mla = GroupedMLAInsertHook(caches, kv_cache_dtype="fp8_e4m3",
                               kv_scales=torch.ones(3), validate=False)
    def mla_step(num_tokens):
        return StepContext(tensors={"kv_c": torch.randn(3, num_tokens, 64, generator=gen),
                                    "k_pe": torch.randn(3, num_tokens, 32, generator=gen),
                                    "slot_mapping": torch.arange(num_tokens)})
    for num_tokens in (1, 5, 9, 30):  # every step size: same keys after the first
        hook(c128_step(num_tokens))
        mla(mla_step(num_tokens))
    launchers = [_launch.shared_launcher(c128_kernel.state_write_kernel),
                 _launch.shared_launcher(c128_kernel.compress_kernel), mla_host.grouped_launcher(True)]
    print(json.dumps({
        "runtime": _launch._direct_runtime() is not None,
        "direct": [lau.direct for lau in launchers],
        "compiled": [lau.num_compiled for lau in launchers],
        "launches": launches, "jit_launches": jit_launches,
    }))
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests launch for real")
def test_real_triton_compile_and_launch_behind_a_stub_driver(tmp_path):
    # Triton's own warmup and CompiledKernel (sm_90) for both hooks; the stub launcher checks
    # that every launch passes exactly the compiled kernel's parameters
    script = tmp_path / "stub_driver_run.py"
    script.write_text(_STUB_DRIVER_RUN)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["runtime"] and result["direct"] == [True, True, True]
    assert result["compiled"] == [1, 1, 1]  # one key per kernel for every step size
    assert result["jit_launches"] == []  # no launch went through JITFunction.run
    assert len(result["launches"]) == 4 * 3
    assert all(stream == 7 for *_, stream in result["launches"])
    assert result["launches"][2] == [1, 3, 1, 7]  # MLA: (token tiles, layers, 1)


_STUB_PACKED_RUN = _STUB_DRIVER_RUN.split("gen = torch.Generator()")[0] + textwrap.dedent(
    """
    import ctypes
    from kvmgr.kernels import packed_launch

    calls = []

    class FakeDriver:  # libcuda's three entry points: records each launch's packed arguments
        def launch(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            calls.append({"function": function.value, "grid": [gx.value, gy.value, gz.value],
                          "block": [bx.value, by.value, bz.value], "stream": stream.value,
                          "extra": extra, "params": [snapshot(params[i]) for i in range(len(params))]})
            return 0
        def current_context(self):
            return 1
        def error_name(self, result):
            return str(result)

    packed_launch._driver = lambda: FakeDriver()
    torch._C._cuda_getDevice = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 7

    def snapshot(address):  # the cell as each width could read it, at the time of the launch
        return {name: ctypes.cast(address, ctypes.POINTER(kind)).contents.value
                for name, kind in (("f32", ctypes.c_float), ("i32", ctypes.c_int32),
                                   ("u64", ctypes.c_uint64))}

    def read(cell, expected):  # small ints are i32 cells, addresses u64 cells
        return cell["f32" if isinstance(expected, float) else "i32" if expected < 2**20 else "u64"]

    gen = torch.Generator().manual_seed(0)
    result = {}
    # the grouped MLA insert: 3 layers, [L, T] slots, two steps of different T
    caches = [torch.zeros(4, 16, 96, dtype=torch.float8_e4m3fn) for _ in range(3)]
    scales = torch.ones(3)
    mla = GroupedMLAInsertHook(caches, kv_cache_dtype="fp8_e4m3", kv_scales=scales, validate=False)
    expected = []
    for num_tokens in (5, 9):
        kv_c = torch.randn(3, num_tokens, 64, generator=gen)
        k_pe = torch.randn(3, num_tokens, 32, generator=gen)
        slots = torch.arange(num_tokens).repeat(3, 1)
        mla(StepContext(tensors={"kv_c": kv_c, "k_pe": k_pe, "slot_mapping": slots}))
        expected.append([kv_c.data_ptr(), k_pe.data_ptr(), mla._plan.table.data_ptr(),
                         slots.data_ptr(), scales.data_ptr(), num_tokens, kv_c.stride(0),
                         k_pe.stride(0), slots.stride(0), 0, 0])
    result["mla_bound"] = mla._insert.num_bound
    result["mla_packed"] = mla._insert._last.is_packed
    # the c128 write (gated off: non-boundary step), then an ungated boundary step
    D, S = 128, 8
    layer = dict(state_cache=torch.randn(8, S, 2 * D, generator=gen),
                 compressed_cache=torch.zeros(8, 4, c128_entry_bytes(D), dtype=torch.uint8),
                 ape=torch.randn(128, D, generator=gen), norm_weight=torch.rand(D, generator=gen),
                 cos_sin_cache=torch.rand(512, 64, generator=gen))
    hook = C128CompressorHook(**layer, gated=False, eps=0.5)
    pos = torch.arange(120, 130)
    table = torch.arange(24, dtype=torch.int32).view(3, 8)
    t = {"positions": pos, "c128.state_slot_mapping": pos % 64, "c128.state_block_table": table,
         "c128.req_indices": torch.zeros(10, dtype=torch.int32), "c128.slot_mapping": torch.arange(10),
         "c128.kv": torch.randn(10, D, generator=gen), "c128.score": torch.randn(10, D, generator=gen)}
    hook(StepContext(tensors=t))
    lay = hook._layer
    expected.append([t["c128.kv"].data_ptr(), t["c128.score"].data_ptr(), lay.ape.data_ptr(),
                     pos.data_ptr(), t["c128.state_slot_mapping"].data_ptr(),
                     lay.state_cache.data_ptr(), D, D, 8 * 2 * D, 2 * D, 64, 0, 0])
    expected.append([lay.state_cache.data_ptr(), table.data_ptr(), t["c128.req_indices"].data_ptr(),
                     pos.data_ptr(), t["c128.slot_mapping"].data_ptr(), lay.norm_weight.data_ptr(),
                     lay.cos_sin_cache.data_ptr(), lay.compressed_cache.data_ptr(), 8 * 2 * D,
                     2 * D, 8, 0.5, 3, 8, 8, 512, 32, 0, 0])
    result["calls"] = [{**c, "params": [read(a, e) for a, e in zip(c["params"], exp)],
                        "num_params": len(c["params"])} for c, exp in zip(calls, expected)]
    result["expected"] = expected
    print(json.dumps(result))
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests launch for real")
def test_packed_arguments_match_the_compiled_kernels_behind_a_stub_driver(tmp_path):
    # Triton compiles the real kernels (sm_90); a fake libcuda records what cuLaunchKernel gets:
    # every packed cell holds the expected pointer or int, in the PTX .entry order, plus the two
    # NULL scratch pointers; each step updates its pointers, T and grid in place
    script = tmp_path / "stub_packed_run.py"
    script.write_text(_STUB_PACKED_RUN)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["mla_bound"] == 1 and result["mla_packed"] is True
    calls, expected = result["calls"], result["expected"]
    assert len(calls) == 4
    for call, want in zip(calls, expected, strict=True):
        assert call["num_params"] == len(want)
        assert call["params"][:-1] == pytest.approx(want[:-1]) and call["params"][-1] == 0
        assert call["stream"] == 7 and call["extra"] is None and call["function"] == 1
    assert [c["grid"] for c in calls] == [[5, 3, 1], [9, 3, 1], [10, 1, 1], [10, 1, 1]]
    assert calls[0]["block"] == [64, 1, 1] and calls[3]["block"] == [128, 1, 1]


# --- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_direct_launches_are_enabled_here():
    # on the NVIDIA machine every check must pass; a silent fallback would void the benchmarks
    assert _launch._direct_runtime() is not None
    launcher = DirectLauncher(_scale_kernel)
    x = torch.randn(100, device="cuda")
    out = torch.empty_like(x)
    launcher((1,), x, out, 100, 2.0, 128, num_warps=4)
    torch.cuda.synchronize()
    assert launcher.direct and launcher.num_compiled == 1
    assert torch.equal(out, x * 2.0 + 100)


@pytest.mark.gpu
def test_gpu_direct_matches_the_normal_launch_and_replays_in_a_graph():
    launcher = DirectLauncher(_scale_kernel)
    gen = torch.Generator(device="cuda").manual_seed(5)
    storage = torch.randn(4099, device="cuda", generator=gen)
    for offset, n in [(0, 4096), (1, 4097), (0, 17), (3, 16), (0, 4096)]:  # alignment and ints
        x = storage[offset : offset + n]
        direct, normal = (torch.full_like(x, float("nan")) for _ in range(2))
        launcher((triton.cdiv(n, 256),), x, direct, n, 0.25, 256, num_warps=4)
        _scale_kernel[(triton.cdiv(n, 256),)](x, normal, n, 0.25, BLOCK=256, num_warps=4)
        torch.cuda.synchronize()
        assert torch.equal(direct, normal) and torch.equal(direct, x * 0.25 + n)
    assert launcher.direct and launcher.num_compiled == 4  # (0, 4096) hit the first key
    # capture: the direct launch is recorded on the capturing stream and replays new data
    x, out = storage[:4096], torch.empty(4096, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launcher((16,), x, out, 4096, 4.0, 256, num_warps=4)  # warm up off capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launcher((16,), x, out, 4096, 4.0, 256, num_warps=4)
    for seed in (6, 7):
        x.copy_(torch.randn(4096, device="cuda", generator=gen.manual_seed(seed)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x * 4.0 + 4096)
    assert launcher.direct


# --- packed launches: argument layout and fallback selection (CPU) ---------------------------

_PTX = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u32 k_param_1,
	.param .f32 k_param_2,
	.param .u64 .ptr .global .align 1 k_param_3,
	.param .u64 .ptr .global .align 1 k_param_4
)
"""


class _FakeDriver:
    def __init__(self):
        self.calls = []

    def launch(self, *args):
        self.calls.append(args)
        return 0

    def current_context(self):
        return 1

    def error_name(self, result):
        return str(result)


def _fake_compiled(**meta):
    from types import SimpleNamespace

    signature = {"x_ptr": "*fp32", "n": "i32", "eps": "fp32", "BLOCK": "constexpr"}
    metadata = SimpleNamespace(num_warps=4, shared=96, num_ctas=1, **meta)
    return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=metadata,
                           asm={"ptx": _PTX}, run=None, function=1234)  # fmt: skip


def _fake_launcher():
    from types import SimpleNamespace

    return SimpleNamespace(kernel=SimpleNamespace(arg_names=["x_ptr", "n", "eps", "BLOCK"]))


def test_param_types_and_ptx_sizes():
    from kvmgr.kernels.packed_launch import param_ctypes, ptx_param_sizes

    assert ptx_param_sizes(_PTX) == [8, 4, 4, 8, 8]
    assert ptx_param_sizes("no entry here") is None
    signature = {"a": "*bf16", "b": "i64", "c": "constexpr", "d": "u1"}
    assert param_ctypes(signature, ["a", "b", "c", "d"]) == ["*bf16", "i64", None, "u1"]
    assert param_ctypes(signature, ["a", "b", "d", "c"]) is None  # another order
    assert param_ctypes({"a": "nvTmaDesc"}, ["a"]) is None  # not packed


def test_pack_fills_cells_and_launches_through_the_driver(monkeypatch):
    from kvmgr.kernels import packed_launch

    driver = _FakeDriver()
    monkeypatch.setattr(packed_launch, "_driver", lambda: driver)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 55, raising=False)
    x, y = torch.empty(8), torch.empty(8)
    knobs = SimpleKnobs()
    bound = packed_launch.pack(_fake_launcher(), _fake_compiled(), [x, 7, 0.25, 64], {}, 0, knobs)
    assert bound is not None and bound.is_packed
    assert [bound.value(i) for i in range(4)] == [x.data_ptr(), 7, 0.25, None]
    bound.set_tensor(0, y)
    bound.set_int(1, 9)
    bound.launch((3, 2, 1))
    (call,) = driver.calls
    assert call[0].value == 1234 and [c.value for c in call[1:8]] == [3, 2, 1, 128, 1, 1, 96]
    assert call[8].value == 55 and call[10] is None
    params = call[9]
    assert len(params) == 5  # x, n, eps and the two NULL hidden pointers
    read = [ctypes.cast(params[i], ctypes.POINTER(kind)).contents.value
            for i, kind in enumerate([ctypes.c_uint64, ctypes.c_int32, ctypes.c_float,
                                      ctypes.c_uint64, ctypes.c_uint64])]  # fmt: skip
    assert read == [y.data_ptr(), 9, 0.25, 0, 0]
    with pytest.raises(OverflowError):
        bound.set_int(1, 2**31)
    assert bound.args == [y, 2**31, 0.25, 64]  # the Python arguments follow the cells


class SimpleKnobs:
    launch_enter_hook = None
    launch_exit_hook = None


@pytest.mark.parametrize(
    "case", ["no_libcuda", "global_scratch", "profile_scratch", "clusters", "ptx_differs", "names"]
)
def test_pack_declines_what_it_cannot_launch(monkeypatch, case):
    from kvmgr.kernels import packed_launch

    monkeypatch.setattr(packed_launch, "_driver", lambda: None if case == "no_libcuda" else _FakeDriver())  # fmt: skip
    meta = {"global_scratch": {"global_scratch_size": 64}, "profile_scratch": {"profile_scratch_size": 8},
            "clusters": {"num_ctas": 2}}.get(case, {})  # fmt: skip
    compiled, launcher = _fake_compiled(), _fake_launcher()
    for name, value in meta.items():
        setattr(compiled.metadata, name, value)
    if case == "ptx_differs":
        compiled.asm["ptx"] = _PTX.replace(".param .u32 k_param_1", ".param .u64 k_param_1")
    if case == "names":
        launcher.kernel.arg_names = ["n", "x_ptr", "eps", "BLOCK"]
    assert packed_launch.pack(launcher, compiled, [torch.empty(2), 7, 0.5, 64], {}, 0, None) is None


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the interpreter's fallback (CPU machines only)"
)
def test_bind_falls_back_to_triton_launches_under_the_interpreter_and_opt_out():
    from kvmgr.kernels.packed_launch import TritonLaunch

    recorded = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: recorded.append((grid, args, kw))

    launcher = DirectLauncher(Kernel())  # not a JITFunction: never direct, never packed
    bound = launcher.bind((4,), torch.empty(2), 3, num_warps=2)
    assert type(bound) is TritonLaunch and not bound.is_packed
    bound.set_int(1, 5)
    bound.launch((6, 1, 1))
    assert (
        recorded[0][0] == (6, 1, 1)
        and recorded[0][1][1] == 5
        and recorded[0][2] == {"num_warps": 2}
    )
    # a JITFunction under the interpreter (conftest) is not packed either
    kernel = JITFunction(_body, do_not_specialize=["m"])
    bound = DirectLauncher(kernel).bind((1,), torch.empty(2), 1, 1, 1.0, True, 16)
    assert type(bound) is TritonLaunch
    assert (
        type(DirectLauncher(kernel).bind((1,), torch.empty(2), 1, 1, 1.0, True, 16, packed=False))
        is TritonLaunch
    )


@pytest.mark.gpu
def test_gpu_packed_launches_are_on_exact_on_streams_and_in_graphs():
    # on the NVIDIA machine packing must succeed (a silent fallback would void the benchmarks);
    # updated cells give the new step's result, on the given stream and under capture (n is
    # not specialized, so any value stays within the compiled specialization)
    launcher = DirectLauncher(triton.jit(_scale_kernel.fn, do_not_specialize=["n"]))
    gen = torch.Generator(device="cuda").manual_seed(9)
    x, out = torch.randn(4096, device="cuda", generator=gen), torch.empty(4096, device="cuda")
    bound = launcher.bind((16,), x, out, 4096, 2.0, 256, num_warps=4)
    assert bound.is_packed, "packing fell back on the GPU"
    for n in (4096, 1000, 17):
        y = torch.randn(n, device="cuda", generator=gen)
        res = torch.full((n,), float("nan"), device="cuda")
        bound.set_tensor(0, y)
        bound.set_tensor(1, res)
        bound.set_int(2, n)
        bound.launch((triton.cdiv(n, 256), 1, 1))
        torch.cuda.synchronize()
        assert torch.equal(res, y * 2.0 + n)
    side = torch.cuda.Stream()
    bound.set_tensor(0, x)
    bound.set_tensor(1, out)
    bound.set_int(2, 4096)
    side.wait_stream(torch.cuda.current_stream())
    bound.launch((16, 1, 1), side)
    side.synchronize()
    assert torch.equal(out, x * 2.0 + 4096)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bound.launch((16, 1, 1))
    bound.set_int(2, 1)  # changing a cell after capture leaves the captured launch as it was
    for seed in (10, 11):
        x.copy_(torch.randn(4096, device="cuda", generator=gen.manual_seed(seed)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x * 2.0 + 4096)


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


def test_kernels_have_no_import_cycles_and_families_do_not_import_each_other():
    graph = _import_graph(ROOT / "kvmgr" / "kernels")
    assert "kvmgr.kernels.mla.kernel" in graph["kvmgr.kernels.mla.host"]  # the graph is read
    assert "kvmgr.kernels.launch" in graph["kvmgr.kernels.c128.host"]
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]  # the finder finds
    for name, targets in graph.items():
        family = name.split(".")[2] if name.count(".") >= 3 else None
        for target in targets:
            other = target.split(".")[2] if target.count(".") >= 3 else None
            assert family is None or other is None or family == other, (name, target)
        if name.endswith(".reference"):  # references import no kernel, host or launcher
            assert not any(t.rsplit(".", 1)[-1] in {"kernel", "host", "api"} for t in targets)
