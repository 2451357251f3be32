"""The baseline op of ``kvmgr bench peer``'s MLA half: its sources and a build that fits a short
GPU slot (private to ``kvmgr.bench``).

Offers:
    KERNEL_SOURCE   the CUDA kernel and a plain C launcher (no torch headers: nvcc compiles it in
                    seconds)
    OP_SOURCE       the op's C++ side: reads the tensors and the current stream, calls the
                    launcher; registered with ``TORCH_LIBRARY`` as ``kvmgr_peer_mla::mla_grouped``
    build_op        compile both (only where needed) and load them; returns the op
    missing_tools   why this machine cannot build it (None when it can)

The kernel follows the published design of vLLM's ``concat_and_cache_mla_grouped`` (not its
code; :mod:`kvmgr.bench.peer_mla` describes it). The op is called from Python as vLLM calls its
cache ops, through ``torch.ops`` (the dispatcher parses the arguments in C++).

**Why two files.** ``load_inline`` puts ``torch/extension.h`` (pybind11 and the whole C++ API)
into the C++ file and this kernel's ``.cu`` included it too: ~40 s of host compiler for the C++
file on the 2-core CPU host and more for nvcc, which ran past a 170-s GPU slot. Here the ``.cu``
includes only CUDA's ``cuda_bf16.h`` / ``cuda_fp8.h`` (~3.5 s on that host) and the ``.cpp``
``torch/library.h`` and ``c10/cuda/CUDAStream.h`` (~7 s); ninja builds them in parallel
(``MAX_JOBS``: the core count unless set), with ``-O2`` and one ``-gencode`` for the GPU's own
architecture, into a persistent folder: a second build with unchanged sources is a no-op.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["KERNEL_SOURCE", "OP_SOURCE", "build_op", "missing_tools"]

_NAME = "kvmgr_peer_mla"

#: The kernel and its launcher: plain CUDA, C linkage, no torch headers.
KERNEL_SOURCE = r"""
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cstdint>

// One CTA per (token, layer): blockIdx.x = token, blockIdx.y = layer.
template <bool FP8>
__global__ void mla_grouped_kernel(
    const __nv_bfloat16* __restrict__ kv_c, const __nv_bfloat16* __restrict__ k_pe,
    const int64_t* __restrict__ cache_ptrs, const int64_t* __restrict__ slots,
    const float* __restrict__ scales, int64_t kv_stride_l, int64_t kv_stride_t,
    int64_t pe_stride_l, int64_t pe_stride_t, int64_t slot_stride_l, int rank, int rope,
    int64_t block_size, int64_t stride_block, int64_t stride_slot, int64_t capacity) {
  const int64_t t = blockIdx.x, l = blockIdx.y;
  const int64_t slot = slots[l * slot_stride_l + t];
  if (slot < 0 || slot >= capacity) return;
  const int64_t row = (slot / block_size) * stride_block + (slot % block_size) * stride_slot;
  const __nv_bfloat16* src_c = kv_c + l * kv_stride_l + t * kv_stride_t;
  const __nv_bfloat16* src_p = k_pe + l * pe_stride_l + t * pe_stride_t;
  if constexpr (FP8) {
    __nv_fp8_storage_t* dst = reinterpret_cast<__nv_fp8_storage_t*>(cache_ptrs[l]) + row;
    const float scale = scales[l];
    for (int i = threadIdx.x; i < rank; i += blockDim.x)
      dst[i] = __nv_cvt_float_to_fp8(__fdiv_rn(__bfloat162float(src_c[i]), scale),
                                     __NV_SATFINITE, __NV_E4M3);
    for (int i = threadIdx.x; i < rope; i += blockDim.x)
      dst[rank + i] = __nv_cvt_float_to_fp8(__fdiv_rn(__bfloat162float(src_p[i]), scale),
                                            __NV_SATFINITE, __NV_E4M3);
  } else {
    __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(cache_ptrs[l]) + row;
    for (int i = threadIdx.x; i < rank; i += blockDim.x) dst[i] = src_c[i];
    for (int i = threadIdx.x; i < rope; i += blockDim.x) dst[rank + i] = src_p[i];
  }
}

// Launches grid (tokens, layers), min(rank, 512) threads; returns the cudaError_t of the launch.
extern "C" int kvmgr_peer_mla_launch(
    const void* kv_c, const void* k_pe, const int64_t* cache_ptrs, const int64_t* slots,
    const float* scales, int64_t kv_stride_l, int64_t kv_stride_t, int64_t pe_stride_l,
    int64_t pe_stride_t, int64_t slot_stride_l, int rank, int rope, int64_t layers,
    int64_t tokens, int64_t block_size, int64_t stride_block, int64_t stride_slot,
    int64_t capacity, bool fp8, void* stream) {
  const dim3 grid(tokens, layers), block(rank < 512 ? rank : 512);
  auto kv = static_cast<const __nv_bfloat16*>(kv_c);
  auto pe = static_cast<const __nv_bfloat16*>(k_pe);
  auto s = static_cast<cudaStream_t>(stream);
  if (fp8) {
    mla_grouped_kernel<true><<<grid, block, 0, s>>>(
        kv, pe, cache_ptrs, slots, scales, kv_stride_l, kv_stride_t, pe_stride_l, pe_stride_t,
        slot_stride_l, rank, rope, block_size, stride_block, stride_slot, capacity);
  } else {
    mla_grouped_kernel<false><<<grid, block, 0, s>>>(
        kv, pe, cache_ptrs, slots, nullptr, kv_stride_l, kv_stride_t, pe_stride_l, pe_stride_t,
        slot_stride_l, rank, rope, block_size, stride_block, stride_slot, capacity);
  }
  return static_cast<int>(cudaGetLastError());
}
"""

#: The op: tensors in, the launcher called on the current CUDA stream.
OP_SOURCE = r"""
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <cstdint>

extern "C" int kvmgr_peer_mla_launch(
    const void* kv_c, const void* k_pe, const int64_t* cache_ptrs, const int64_t* slots,
    const float* scales, int64_t kv_stride_l, int64_t kv_stride_t, int64_t pe_stride_l,
    int64_t pe_stride_t, int64_t slot_stride_l, int rank, int rope, int64_t layers,
    int64_t tokens, int64_t block_size, int64_t stride_block, int64_t stride_slot,
    int64_t capacity, bool fp8, void* stream);

namespace {

void mla_grouped(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& cache_ptrs,
                 const at::Tensor& slots, const at::Tensor& scales, int64_t block_size,
                 int64_t stride_block, int64_t stride_slot, int64_t capacity, bool fp8) {
  const int64_t layers = kv_c.size(0), tokens = kv_c.size(1);
  if (tokens == 0) return;
  const int64_t slot_stride_l = slots.dim() == 2 ? slots.stride(0) : 0;
  const int status = kvmgr_peer_mla_launch(
      kv_c.data_ptr(), k_pe.data_ptr(), cache_ptrs.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
      fp8 ? scales.data_ptr<float>() : nullptr, kv_c.stride(0), kv_c.stride(1), k_pe.stride(0),
      k_pe.stride(1), slot_stride_l, static_cast<int>(kv_c.size(2)),
      static_cast<int>(k_pe.size(2)), layers, tokens, block_size, stride_block, stride_slot,
      capacity, fp8, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(status == 0, "kvmgr_peer_mla::mla_grouped: the launch failed, cudaError ", status);
}

}  // namespace

TORCH_LIBRARY(kvmgr_peer_mla, m) {
  m.def("mla_grouped(Tensor kv_c, Tensor k_pe, Tensor cache_ptrs, Tensor slots, Tensor scales, "
        "int block_size, int stride_block, int stride_slot, int capacity, bool fp8) -> ()");
}

TORCH_LIBRARY_IMPL(kvmgr_peer_mla, CUDA, m) { m.impl("mla_grouped", &mla_grouped); }
"""


def missing_tools() -> str | None:
    """Why this machine cannot build the op (no nvcc, no ninja, no C++ compiler), or None."""
    from torch.utils import cpp_extension

    cuda_home = cpp_extension.CUDA_HOME
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return "no nvcc (set CUDA_HOME or put nvcc on PATH)"
    if not cpp_extension.is_ninja_available():
        return "no ninja (pip install ninja)"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++, or $CXX)"
    return None


def _arch() -> str:
    """``compute_XY`` of the current GPU (``9.0`` -> ``90``)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def _write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` unless ``path`` already holds it (ninja then sees nothing to rebuild)."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


@functools.cache
def build_op(build_dir: str | None = None, verbose: bool = False) -> Any:
    """Compile (where the sources or flags changed) and load the op; once per process.

    Args:
        build_dir: the persistent build folder; default ``$KVMGR_PEER_BUILD_DIR``, else
            ``~/.cache/kvmgr/peer_mla-sm<arch>``.
        verbose: print the compiler commands.

    Returns:
        ``torch.ops.kvmgr_peer_mla.mla_grouped``: ``(kv_c, k_pe, cache_ptrs, slots, scales,
        block_size, stride_block, stride_slot, capacity, fp8) -> None``; ``kv_c`` / ``k_pe``
        bf16 ``[L, T, R]`` / ``[L, T, P]``, ``cache_ptrs`` int64 ``[L]`` on the device, ``slots``
        int64 ``[T]`` or ``[L, T]``, ``scales`` float32 ``[L]`` (read only when ``fp8``).

    Raises:
        RuntimeError: a tool is missing (:func:`missing_tools` says which) or the build failed.
    """
    import torch
    from torch.utils.cpp_extension import load

    missing = missing_tools()
    if missing is not None:
        raise RuntimeError(f"cannot build the peer MLA op: {missing}")
    arch = _arch()
    folder = Path(build_dir or os.environ.get("KVMGR_PEER_BUILD_DIR") or Path.home() / ".cache" / "kvmgr" / f"peer_mla-sm{arch}")  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    kernel, op = folder / "peer_mla_kernel.cu", folder / "peer_mla_op.cpp"
    _write_if_changed(kernel, KERNEL_SOURCE)
    _write_if_changed(op, OP_SOURCE)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    load(  # type: ignore[no-untyped-call]
        name=_NAME, sources=[str(op), str(kernel)], extra_cflags=["-O2"],
        extra_cuda_cflags=["-O2", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
        build_directory=str(folder), is_python_module=False, verbose=verbose,
    )  # fmt: skip
    return torch.ops.kvmgr_peer_mla.mla_grouped
