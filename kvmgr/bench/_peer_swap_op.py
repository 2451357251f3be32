"""The baseline op of ``kvmgr bench peer``'s swap half: C++ source and its build (private to
``kvmgr.bench``; ``kvmgr.bench.peer_swap`` re-exports both names).

Offers:
    CPP_SOURCE       a batched page copy after the published design of vLLM's
                     ``swap_blocks_batch`` (``kvmgr.bench.peer_swap`` describes it)
    build_baseline   compile and load it with ``torch.utils.cpp_extension.load_inline``
"""

from __future__ import annotations

from typing import Any

__all__ = ["CPP_SOURCE", "build_baseline"]

#: The baseline op. Minimal driver types are declared here, so it compiles against torch's
#: headers alone; the driver is reached through ``dlopen("libcuda.so.1")`` at the first call.
CPP_SOURCE = r"""
#include <torch/extension.h>
#include <dlfcn.h>
#include <cstdint>

namespace {

using CUresult = int;
using CUstream = void*;
struct MemLocation { int type; int id; };                     // CUmemLocation_v1
struct MemcpyAttributes {                                      // CUmemcpyAttributes_v1
  int src_access_order;
  MemLocation src_hint;
  MemLocation dst_hint;
  unsigned int flags;
};
static_assert(sizeof(MemcpyAttributes) == 24, "CUmemcpyAttributes_v1 has 24 bytes");

// PFN_cuMemcpyBatchAsync_v12080: dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs,
// failIdx, stream.
using BatchFn = CUresult (*)(void**, void**, size_t*, size_t, MemcpyAttributes*, size_t*,
                             size_t, size_t*, CUstream);
using CopyFn = CUresult (*)(uint64_t, uint64_t, size_t, CUstream);  // cuMemcpyAsync_v4000
using GetProcFn = CUresult (*)(const char*, void**, int, uint64_t, int*);  // _v2

constexpr int kOrderStream = 1;       // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
constexpr size_t kNoIndex = SIZE_MAX;

struct Driver {
  BatchFn batch = nullptr;
  CopyFn copy = nullptr;
};

void* lookup(GetProcFn get, const char* symbol, int version) {
  void* fn = nullptr;
  int status = -1;
  if (get(symbol, &fn, version, 0, &status) != 0 || status != 0) return nullptr;
  return fn;
}

Driver resolve() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(lib != nullptr, "peer swap op: cannot open libcuda.so.1");
  auto get = reinterpret_cast<GetProcFn>(dlsym(lib, "cuGetProcAddress_v2"));
  TORCH_CHECK(get != nullptr, "peer swap op: no cuGetProcAddress_v2 in the driver");
  Driver driver;
  driver.batch = reinterpret_cast<BatchFn>(lookup(get, "cuMemcpyBatchAsync", 12080));
  driver.copy = reinterpret_cast<CopyFn>(lookup(get, "cuMemcpyAsync", 4000));
  TORCH_CHECK(driver.batch != nullptr || driver.copy != nullptr,
              "peer swap op: neither cuMemcpyBatchAsync nor cuMemcpyAsync resolved");
  return driver;
}

const Driver& driver() {
  static const Driver resolved = resolve();  // once per process, thread-safe
  return resolved;
}

void check_table(const torch::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kInt64 && t.is_contiguous() &&
              t.dim() == 1 && t.numel() == n, name, ": expected a contiguous int64 CPU tensor of ",
              n, " entries");
}

}  // namespace

// Copy sizes[i] bytes from src_ptrs[i] to dst_ptrs[i] for every i, on `stream` (a CUstream
// handle), in one batched driver call. Returns whether the batched entry point was used.
bool swap_blocks_batch(const torch::Tensor& src_ptrs, const torch::Tensor& dst_ptrs,
                       const torch::Tensor& sizes, int64_t stream) {
  const int64_t n = sizes.numel();
  check_table(src_ptrs, "src_ptrs", n);
  check_table(dst_ptrs, "dst_ptrs", n);
  check_table(sizes, "sizes", n);
  if (n == 0) return true;
  const Driver& d = driver();
  auto handle = reinterpret_cast<CUstream>(stream);
  auto* dst = reinterpret_cast<void**>(dst_ptrs.data_ptr<int64_t>());
  auto* src = reinterpret_cast<void**>(src_ptrs.data_ptr<int64_t>());
  auto* len = reinterpret_cast<size_t*>(sizes.data_ptr<int64_t>());
  if (d.batch != nullptr) {
    MemcpyAttributes attrs{};
    attrs.src_access_order = kOrderStream;
    size_t attrs_index = 0;
    size_t fail_index = kNoIndex;
    CUresult r = d.batch(dst, src, len, static_cast<size_t>(n), &attrs, &attrs_index, 1,
                         &fail_index, handle);
    TORCH_CHECK(r == 0, "cuMemcpyBatchAsync failed with CUresult ", r, " at copy ",
                fail_index == kNoIndex ? -1 : static_cast<int64_t>(fail_index));
    return true;
  }
  for (int64_t i = 0; i < n; ++i) {
    CUresult r = d.copy(reinterpret_cast<uint64_t>(dst[i]), reinterpret_cast<uint64_t>(src[i]),
                        len[i], handle);
    TORCH_CHECK(r == 0, "cuMemcpyAsync failed with CUresult ", r, " at copy ", i);
  }
  return false;
}
"""


def build_baseline(verbose: bool = False) -> Any:
    """Compile and load the baseline op (cached by torch across runs).

    Returns:
        The extension module; its ``swap_blocks_batch(src_ptrs, dst_ptrs, sizes, stream)`` takes
        int64 CPU tensors ``[n]`` and a ``CUstream`` handle, returns whether it batched.

    Raises:
        RuntimeError: no compiler or ninja, or the build failed.
    """
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="kvmgr_peer_swap",
        cpp_sources=CPP_SOURCE,
        functions=["swap_blocks_batch"],
        extra_ldflags=["-ldl"],
        verbose=verbose,
    )
