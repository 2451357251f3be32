"""GPU smoke test of the transfer stack: run it first on a new machine.

    python scripts/gpu_smoke_transfer.py

Each step prints OK or FAIL with the traceback and the next step still runs; the exit status is
the number of failed steps. Steps: versions, entry-point resolution per ABI, struct layout,
pinned registration (checked with the driver's pointer attributes: torch's ``is_pinned()`` says
False for registered memory), the three copy paths (ctypes batch, cuda-python lists, per-copy
loop), the legacy-default-stream fallback, a refused batch, and a round trip through each engine
(``cuda``, ``kernel``, ``auto``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from kvmgr.errors import TransferError
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer import driver as copy_driver
from kvmgr.transfer.plan import Direction, build_plan


def _step(failed: list[str], name: str, fn: Callable[[], object]) -> None:
    print(f"--- {name}", flush=True)
    start = time.perf_counter()
    try:
        out = fn()
    except Exception:
        traceback.print_exc()
        print(f"FAIL {name}", flush=True)
        failed.append(name)
        return
    detail = f": {out}" if out is not None else ""
    print(f"OK   {name} ({(time.perf_counter() - start) * 1e3:.1f} ms){detail}", flush=True)


def versions() -> str:
    import cuda.bindings

    assert torch.cuda.is_available(), "torch sees no CUDA device"
    return (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), cuda-bindings "
        f"{cuda.bindings.__version__}, {torch.cuda.get_device_name()}"
    )


def raw_proc_address() -> None:
    from cuda.bindings import driver as cu

    print("cuInit:", cu.cuInit(0), " cuDriverGetVersion:", cu.cuDriverGetVersion())
    for version in (13000, 12080):
        print(
            f"cuGetProcAddress(cuMemcpyBatchAsync, {version}):",
            cu.cuGetProcAddress(b"cuMemcpyBatchAsync", version, 1),
        )
    print("cuGetProcAddress(cuMemcpyAsync, 4000):", cu.cuGetProcAddress(b"cuMemcpyAsync", 4000, 1))


def layout() -> str:
    assert copy_driver.attrs_layout_matches() is True, (
        "MemcpyAttributes differs from cuda-python's struct"
    )
    return "CUmemcpyAttributes: 24 B, bytes match cuda-python"


class Pages:
    """3 GPU tensors and 3 pinned host tensors of 16 pages x 1152 B; a scattered D2H plan."""

    def __init__(self) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.gpu = [
            torch.randint(0, 256, (16, 1152), dtype=torch.uint8, device="cuda", generator=gen)
            for _ in range(3)
        ]
        self.host = [torch.zeros(16, 1152, dtype=torch.uint8).pin_memory() for _ in range(3)]
        self.src_ids, self.dst_ids = np.array([1, 2, 3, 9, 14]), np.array([0, 1, 2, 7, 12])
        self.plan = build_plan(
            Direction.D2H,
            KVLayout.from_tensors(self.gpu),
            KVLayout.from_tensors(self.host),
            self.src_ids,
            self.dst_ids,
        )

    def run(self, copy: Callable[[int], object], stream: torch.cuda.Stream | None) -> str:
        for h in self.host:
            h.fill_(0xA5)
        torch.cuda.synchronize()
        result = copy(0 if stream is None else stream.cuda_stream)
        torch.cuda.synchronize()
        for g, h in zip(self.gpu, self.host):
            assert torch.equal(
                g[torch.from_numpy(self.src_ids).cuda()].cpu(), h[torch.from_numpy(self.dst_ids)]
            ), "wrong bytes"
        return f"{self.plan.num_descriptors} descriptors, path {result}"


def main() -> int:
    failed: list[str] = []

    def step(name: str, fn: Callable[[], object]) -> None:
        _step(failed, name, fn)

    step("versions", versions)
    step("raw cuGetProcAddress", raw_proc_address)
    step("struct layout", layout)
    holder: list[copy_driver.CopyDriver] = []

    def make_driver() -> str:
        holder.append(copy_driver.CopyDriver())
        return f"batch ABI {holder[0].batch_abi}, driver CUDA {holder[0].driver_version}"

    step("CopyDriver()", make_driver)
    if not holder:
        return len(failed)
    driver = holder[0]
    from kvmgr.transfer.pinned import PinnedHostBuffer

    def pinned() -> str:
        from kvmgr.transfer.pinned import mapped_device_pointer

        buf = PinnedHostBuffer(64 << 20)
        try:
            address = buf.tensor.data_ptr()
            mapped = mapped_device_pointer(address)
            assert mapped == address, f"driver maps {address:#x} at {mapped}"
            return (
                f"64 MiB registered in {buf.register_s * 1e3:.1f} ms; driver: host memory mapped "
                f"at the same address; torch is_pinned()={buf.tensor.is_pinned()} (not relied on)"
            )
        finally:
            buf.close()

    step("pinned registration", pinned)
    pages, stream = Pages(), torch.cuda.Stream()
    p = pages.plan
    step(
        "batch via ctypes + numpy",
        lambda: pages.run(
            lambda s: driver.copy("batch", p.dst_addrs, p.src_addrs, p.sizes, s, 1), stream
        ),
    )
    step(
        "batch via cuda-python lists",
        lambda: pages.run(
            lambda s: driver.copy("batch", p.dst_addrs, p.src_addrs, p.sizes, s, 1, call="lists"),
            stream,
        ),
    )
    step(
        "per-copy loop",
        lambda: pages.run(
            lambda s: driver.copy("loop", p.dst_addrs, p.src_addrs, p.sizes, s, 1), stream
        ),
    )
    step(
        "legacy default stream -> loop",
        lambda: pages.run(
            lambda s: driver.copy("batch", p.dst_addrs, p.src_addrs, p.sizes, s, 1), None
        ),
    )

    def refused() -> str:
        try:
            driver.batch_ctypes(p.dst_addrs, p.src_addrs, p.sizes, stream.cuda_stream, 0)
        except TransferError as exc:
            return f"refused as expected: {exc} (fail_index={exc.fail_index})"
        raise AssertionError("an INVALID access order was accepted")

    step("refused batch (INVALID access order)", refused)

    def engine_round_trip(name: str) -> str:
        from kvmgr.transfer import make_engine

        with contextlib.closing(make_engine(name, torch.device("cuda"))) as engine:
            host = engine.allocate_host(3 * 16 * 1152).view(3, 16, 1152).unbind(0)
            gl, hl = KVLayout.from_tensors(pages.gpu), KVLayout.from_tensors(list(host))
            store = engine.submit(build_plan(Direction.D2H, gl, hl, [1, 2, 3, 9], [4, 5, 6, 0]))
            print("store:", store.future.result(timeout=30))
            for g in pages.gpu:
                g[torch.tensor([10, 11, 12, 13], device="cuda")] = 0xEE
            load = engine.submit(
                build_plan(Direction.H2D, hl, gl, [4, 5, 6, 0], [10, 11, 12, 13]), wait_for=[store]
            )
            engine.stream_wait(load)
            for g in pages.gpu:
                assert torch.equal(g[10:14], g[torch.tensor([1, 2, 3, 9], device="cuda")]), (
                    "round trip bytes differ"
                )
            print("load:", load.future.result(timeout=30))
            return str(engine.statistics())

    for name in ("cuda", "kernel", "auto"):
        step(f"engine round trip: {name}", functools.partial(engine_round_trip, name))

    def info() -> None:
        from kvmgr.transfer.info import collect_info

        for key, value in collect_info().items():
            print(f"  {key:22} {value}")

    step("collect_info", info)
    print(f"\n{len(failed)} failed: {failed}" if failed else "\nall steps OK")
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
