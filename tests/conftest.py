"""Shared pytest setup.

- Without a GPU, Triton kernels run under its interpreter: ``TRITON_INTERPRET=1`` must be set
  before any ``@triton.jit`` function is defined, so it is set here, before kvmgr is imported.
- ``gpu``-marked tests are skipped where no CUDA device is present.
- Under the interpreter, float -> FP8 (e4m3fn, e5m2) conversions are routed through torch: the
  interpreter's own conversion rounds ties away from zero, flushes subnormals and does not
  saturate, while the GPU rounds to nearest even and saturates (``cvt.rn.satfinite``). Kernel
  tests then compare FP8 bytes exactly instead of loosening tolerances.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest_plugins = ["tiers_server", "mounts"]  # real servers and filesystems for the tier tests

# The test files live in folders that mirror kvmgr's packages (scripts/mirror_tests.py); they
# import one another and the helpers here by their plain names, as when they shared one folder.
sys.path[:0] = sorted({str(p.parent) for p in Path(__file__).parent.glob("*/**/test_*.py")})

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _torch_fp8_convert(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the interpreter's ``_convert_float`` so float -> FP8 goes through torch.

    The wrapped function keeps the original's contract: ``input`` is the numpy payload of a
    Triton tensor (bf16 as raw ``uint16`` bits, FP8 as ``uint8``) and the result is an unsigned
    integer array of the output width, shaped like ``input``. Values are clamped to the format's
    largest finite value first (saturation; NaN stays NaN), then cast with round-to-nearest-even.
    Anything else (upcasts, other formats, round-toward-zero) uses the original.
    """
    import triton.language as tl
    from triton._C.libtriton import ir

    fp8_targets = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    float_sources = {tl.float16: np.float16, tl.float32: np.float32, tl.float64: np.float64}

    def convert(input: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> Any:
        target = fp8_targets.get(output_dtype)
        is_source_float = input_dtype in float_sources or input_dtype == tl.bfloat16
        if target is None or not is_source_float or rounding_mode == ir.ROUNDING_MODE.RTZ:
            return original(input, input_dtype, output_dtype, rounding_mode)
        array = np.ascontiguousarray(input)
        if input_dtype == tl.bfloat16:  # stored as raw uint16 bits
            values = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
        else:
            values = torch.from_numpy(array.astype(float_sources[input_dtype]))
        if values.dtype != torch.float64:  # every bf16/fp16/fp32 value is exact in fp32
            values = values.to(torch.float32)
        limit = torch.finfo(target).max
        values = values.clamp(-limit, limit)
        return values.to(target).view(torch.uint8).numpy().reshape(np.shape(input))

    return convert


@pytest.fixture(autouse=True, scope="session")
def _interpreter_fp8_via_torch() -> Iterator[None]:
    """Patch the Triton interpreter's FP8 conversion for the whole session (interpreter only)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:  # no Triton: nothing to patch
        yield
        return
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setattr(
            interpreter, "_convert_float", _torch_fp8_convert(interpreter._convert_float)
        )
        yield


_PTX_SUMMARY = """
import json as _json, re as _re
_ops = sorted(set(_re.findall(r"(?:ld|st)[.]global[.a-z0-9]*", kernel.asm["ptx"])))
_widths = [f"{op}.global.{w}" for op in ("ld", "st") for w in ("v4.b32", "b64", "b32", "b16", "b8")]
print(_json.dumps({"ops": _ops, "missing_widths": [w for w in _widths if w not in _ops],
                   "shared": kernel.metadata.shared,
                   "converts": kernel.asm["ttgir"].count("convert_layout")}))
"""


@pytest.fixture
def compile_for_sm90() -> Callable[[str], dict[str, Any]]:
    """Run a script that compiles a Triton kernel for sm_90 into ``kernel`` (no GPU needed:
    Triton ships ptxas) in a process without ``TRITON_INTERPRET``; return what its PTX holds:
    ``ops`` (the global load/store instructions), ``missing_widths`` (which of the 16-, 8-, 4-,
    2- and 1-byte loads and stores it lacks), ``shared`` (shared memory bytes) and ``converts``
    (layout conversions in its TTGIR)."""
    import json
    import subprocess
    import sys

    def run(script: str) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        out = subprocess.run(
            [sys.executable, "-c", script + _PTX_SUMMARY],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.splitlines()[-1])

    return run
