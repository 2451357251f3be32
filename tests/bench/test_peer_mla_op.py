"""The peer MLA baseline's build (``kvmgr.bench._peer_mla_op``): both sources compile with the
flags the build uses, and a machine without the tools is told why instead of failing mid-build."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from kvmgr.bench import _peer_mla_op, peer_mla

# what torch's cpp_extension adds to every nvcc command
_TORCH_NVCC_FLAGS = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                     "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
                     "--expt-relaxed-constexpr"]  # fmt: skip


def _nvcc() -> str | None:
    home = cpp_extension.CUDA_HOME
    path = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    return path if path and os.path.exists(path) else None


@pytest.mark.skipif(_nvcc() is None, reason="no nvcc on this machine")
def test_both_sources_compile_with_the_builds_flags(tmp_path: Path) -> None:
    # The kernel with nvcc for sm_90 (-O2, one -gencode, as build_op); the op's C++ side with
    # the host compiler against torch's headers, syntax only (a CPU-only torch cannot link it).
    nvcc = _nvcc()
    assert nvcc is not None
    kernel = tmp_path / "kernel.cu"
    kernel.write_text(_peer_mla_op.KERNEL_SOURCE)
    subprocess.run([nvcc, "-O2", "-std=c++17", "-Xcompiler", "-fPIC", "-gencode=arch=compute_90,code=sm_90", *_TORCH_NVCC_FLAGS,
                    "-c", str(kernel), "-o", str(tmp_path / "kernel.o")], check=True)  # fmt: skip
    include = Path(torch.__file__).parent / "include"
    macros = include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub = tmp_path / "stub"
    if not macros.exists():  # a CPU-only torch ships c10/cuda without this generated header
        (stub / "c10" / "cuda" / "impl").mkdir(parents=True)
        (stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text("#pragma once\n")
    op = tmp_path / "op.cpp"
    op.write_text(_peer_mla_op.OP_SOURCE)
    subprocess.run([os.environ.get("CXX", "c++"), "-std=c++20", "-O2", "-fsyntax-only", "-w",
                    f"-I{include}", f"-I{stub}", *_cuda_includes(nvcc, tmp_path), str(op)], check=True)  # fmt: skip


def _cuda_includes(nvcc: str, tmp_path: Path) -> list[str]:
    """The include flags nvcc gives its host compiler (``--dryrun``: nvcc may be a wrapper)."""
    (tmp_path / "empty.cu").write_text("")
    lines = subprocess.run([nvcc, "--dryrun", "-c", str(tmp_path / "empty.cu")], capture_output=True,
                           text=True, check=True).stderr.splitlines()  # fmt: skip
    found = next(line for line in lines if "INCLUDES=" in line and "SYSTEM" not in line)
    return found.split("=", 1)[1].replace('"', "").split()


def test_missing_nvcc_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(_peer_mla_op.shutil, "which", lambda name: None)
    assert "nvcc" in (_peer_mla_op.missing_tools() or "")
    with pytest.raises(RuntimeError, match="nvcc"):
        _peer_mla_op.build_op.__wrapped__("/nonexistent")


def test_the_bench_stops_with_a_message_when_it_cannot_build(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a GPU machine without nvcc: exit 2 and say what is missing, before any case runs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_peer_mla_op, "missing_tools", lambda: "no nvcc (set CUDA_HOME)")
    monkeypatch.setattr(_peer_mla_op, "build_op", lambda *a, **k: pytest.fail("built anyway"))
    assert peer_mla.run_peer_mla(argparse.Namespace()) == 2
    assert "cannot build the C++ baseline here: no nvcc" in capsys.readouterr().err
