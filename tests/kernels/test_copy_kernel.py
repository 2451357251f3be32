"""The copy-page kernel (interpreter on CPU tensors, or the GPU), its engines and the cost model."""

from __future__ import annotations

import json
import os
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from cuda_fakes import FakeDriver, KernelFakeCuda, cpu_table_slot, hold_two_tables

from kvmgr.errors import ConfigError, GeometryError, TransferError
from kvmgr.kernels.copy import staging
from kvmgr.kernels.copy.pages import (
    copy_pages,
    copy_pages_reference,
    launch_copy_pages,
    launch_copy_table,
)
from kvmgr.kernels.copy.row import vector_widths
from kvmgr.kernels.copy.tables import build_descriptor_table
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer import auto, cost_model, cuda_engine, kernel
from kvmgr.transfer.cost_model import Calibration, kernel_or_batch
from kvmgr.transfer.cuda_engine import AutoEngine, CopyKernelEngine
from kvmgr.transfer.plan import Direction, TransferPlan, build_plan

POISON = 0xA5
ODD_SIZES = [1, 3, 576, 584, 656, 17, 1152, 4096]
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random_bytes(rng: np.random.Generator, n: int, device: str = "cpu") -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)).to(device)


def _disjoint_offsets(
    rng: np.random.Generator, sizes: list[int], align: int, skew: int
) -> np.ndarray:
    """Offsets of non-overlapping ranges in sequence, each ``skew (mod align)``, random gaps."""
    offsets, cursor = [], 0
    for size in sizes:
        cursor += int(rng.integers(0, 64))
        cursor += (skew - cursor) % align
        offsets.append(cursor)
        cursor += size
    return np.array(offsets, dtype=np.int64)


def _plan(
    rng: np.random.Generator, sizes: list[int], skews: tuple[int, int], device: str = KERNEL_DEVICE
):
    """Random source bytes, a poisoned destination (both on ``device``) and descriptors between
    them: source offsets ``skews[0]`` and destination offsets ``skews[1]`` modulo 16."""
    src_off = _disjoint_offsets(rng, sizes, 16, skews[0])
    dst_off = _disjoint_offsets(rng, list(reversed(sizes)), 16, skews[1])[::-1].copy()
    span = int(max(src_off.max(), dst_off.max()) + max(sizes) + 64)
    src = _random_bytes(rng, span, device)
    dst = torch.full((span,), POISON, dtype=torch.uint8, device=device)
    return src, dst, src.data_ptr() + src_off, dst.data_ptr() + dst_off, np.array(sizes)


def _expected(src: torch.Tensor, dst: torch.Tensor, srcs, dsts, sizes) -> torch.Tensor:
    """What ``dst`` must hold after copying ``src`` bytes at addresses ``srcs`` to ``dsts``
    (addresses inside ``src`` and ``dst``), computed by slicing: independent of both copies."""
    out = dst.clone()
    for s, d, n in zip(srcs - src.data_ptr(), dsts - dst.data_ptr(), sizes):
        out[int(d) : int(d) + int(n)] = src[int(s) : int(s) + int(n)]
    return out


def _run(srcs, dsts, sizes, **kwargs) -> torch.Tensor:
    table = copy_pages(srcs, dsts, sizes, device=KERNEL_DEVICE, **kwargs)
    if KERNEL_DEVICE == "cuda":
        torch.cuda.synchronize()
    return table


# ------------------------------------------------------------------ kernel vs reference


@pytest.mark.parametrize("skews", [(0, 0), (8, 8), (4, 12), (2, 6), (1, 0), (3, 5)])
def test_kernel_copies_odd_sizes_and_keeps_poison(skews: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(skews))
    sizes = [int(s) for s in rng.permutation(ODD_SIZES)]
    src, dst, srcs, dsts, n = _plan(rng, sizes, skews)
    expected = _expected(src, dst, srcs, dsts, n)
    _run(srcs, dsts, n, max_programs=3)
    assert torch.equal(dst, expected)
    assert (dst == POISON).sum() > 0  # bytes outside the descriptors stay poisoned


def test_table_launches_bind_once_per_specialization_and_copy_exactly() -> None:
    # The engines' packed launches: 1 row (a constexpr 1), 16 and 32 rows (multiples of 16) and
    # 5 / 7 rows share bound launches by class; every launch copies exactly its rows.
    from kvmgr.kernels.copy.pages import copy_table_launches

    launches = copy_table_launches()
    stream = torch.cuda.current_stream() if KERNEL_DEVICE == "cuda" else None
    for step, rows in enumerate([5, 1, 16, 7, 32, 1, 5]):
        rng = np.random.default_rng(40 + step)
        sizes = [int(s) for s in rng.choice(ODD_SIZES, rows)]
        src, dst, srcs, dsts, n = _plan(rng, sizes, (step % 4, 0))
        expected = _expected(src, dst, srcs, dsts, n)
        table = torch.from_numpy(build_descriptor_table(srcs, dsts, n)).to(KERNEL_DEVICE)
        assert launch_copy_table(table, rows, 4, stream=stream, launches=launches) == min(4, rows)
        if KERNEL_DEVICE == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(dst, expected)
    assert launches.num_bound == 3


def test_kernel_matches_memmove_reference() -> None:
    rng = np.random.default_rng(7)
    sizes = [int(s) for s in rng.integers(1, 3000, 24)]
    src, dst, srcs, dsts, n = _plan(rng, sizes, (5, 9))
    # The reference copies between CPU copies of the same buffers, at the same offsets.
    src_cpu, ref = src.cpu(), dst.cpu()
    ref_srcs = src_cpu.data_ptr() + (srcs - src.data_ptr())
    ref_dsts = ref.data_ptr() + (dsts - dst.data_ptr())
    expected = _expected(src_cpu, ref, ref_srcs, ref_dsts, n)
    copy_pages_reference(ref_srcs, ref_dsts, n)
    assert torch.equal(ref, expected)
    _run(srcs, dsts, n, max_programs=4)
    assert torch.equal(dst.cpu(), ref)


def test_every_vector_width_is_exercised() -> None:
    # The kernel branches on alignment; the test plans must reach all five branches.
    rng = np.random.default_rng(3)
    widths = set()
    for skews in [(0, 0), (8, 8), (4, 12), (2, 6), (1, 0)]:
        _, _, srcs, dsts, n = _plan(rng, ODD_SIZES, skews)
        widths |= set(vector_widths(build_descriptor_table(srcs, dsts, n)).tolist())
    assert widths == {1, 2, 4, 8, 16}


def test_merged_runs_are_sliced_and_copied_whole() -> None:
    # One 5,000-byte run and one 1,600-byte run, sliced at 256 B over 2 programs.
    rng = np.random.default_rng(11)
    src, dst, srcs, dsts, n = _plan(rng, [5000, 1600, 584], (0, 8))
    table = build_descriptor_table(srcs, dsts, n, chunk_bytes=256)
    assert table.shape == (3, 20 + 7 + 3) and table[2].sum() == n.sum()
    expected = _expected(src, dst, srcs, dsts, n)
    _run(srcs, dsts, n, max_programs=2, chunk_bytes=256)
    assert torch.equal(dst, expected)


def test_more_rows_than_programs_and_a_single_program() -> None:
    rng = np.random.default_rng(5)
    src, dst, srcs, dsts, n = _plan(rng, [576] * 9, (0, 0))
    expected = _expected(src, dst, srcs, dsts, n)
    table = torch.from_numpy(build_descriptor_table(srcs, dsts, n)).to(KERNEL_DEVICE)
    assert launch_copy_pages(table, max_programs=1) == 1
    if KERNEL_DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("size", [1, 584, 70_001])
def test_a_single_descriptor(size: int) -> None:
    # One row: on a GPU, Triton receives num_items == 1 as a compile-time constant.
    rng = np.random.default_rng(size)
    src, dst, srcs, dsts, n = _plan(rng, [size], (8, 0))
    expected = _expected(src, dst, srcs, dsts, n)
    _run(srcs, dsts, n, chunk_bytes=1 << 20)
    assert torch.equal(dst, expected)


def test_empty_plan_launches_nothing() -> None:
    empty = np.zeros(0, dtype=np.int64)
    assert _run(empty, empty, empty).shape == (3, 0)


_COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvmgr.kernels.copy.pages import _copy_pages_kernel
from kvmgr.kernels.copy.row import NUM_WARPS as _NUM_WARPS
target, options = GPUTarget("cuda", 90, 32), {"num_warps": _NUM_WARPS}
# num_items == 1 reaches the kernel as a constexpr (Triton specializes the integer 1)
one = ASTSource(_copy_pages_kernel, {"table_ptr": "*i64", "num_items": "constexpr"}, {"num_items": 1})
triton.compile(one, target=target, options=options)
source = ASTSource(_copy_pages_kernel, {"table_ptr": "*i64", "num_items": "i32"}, {})
kernel = triton.compile(source, target=target, options=options)
"""


def test_kernel_compiles_to_vector_loads_for_the_h200(compile_for_sm90) -> None:
    # The interpreter cannot see vector widths: compile for sm_90 (no GPU needed; Triton ships
    # ptxas) in a process without TRITON_INTERPRET and read the PTX.
    info = compile_for_sm90(_COMPILE_FOR_SM90)
    assert info["missing_widths"] == [], info["ops"]  # 16-, 8-, 4-, 2- and 1-byte branches
    assert (info["shared"], info["converts"]) == (0, 0)  # no shuffles through shared memory


# ------------------------------------------------------------------ descriptor table


def test_table_slices_keep_alignment_and_order() -> None:
    srcs = np.array([4096, 10_000_008, 77], dtype=np.int64)
    dsts = np.array([8192, 20_000_000, 99], dtype=np.int64)
    sizes = np.array([100_000, 584, 0], dtype=np.int64)
    table = build_descriptor_table(srcs, dsts, sizes, chunk_bytes=32768)
    assert table.dtype == np.int64 and table.flags.c_contiguous
    assert table[2].tolist() == [32768, 32768, 32768, 1696, 584]  # the empty one is dropped
    assert table[0, :4].tolist() == [4096 + 32768 * k for k in range(4)]
    assert set(vector_widths(table[:, :4]).tolist()) == {16}


@pytest.mark.parametrize(
    ("srcs", "dsts", "sizes", "match"),
    [
        ([1, 2], [3], [4], "equal lengths"),
        ([16], [32], [-1], "sizes >= 0"),
        ([0], [32], [8], "positive addresses"),
        ([[16]], [[32]], [[8]], "1-D"),
        ([16.0], [32.0], [8.0], "integers"),
    ],
)
def test_table_rejects_bad_descriptors(srcs, dsts, sizes, match: str) -> None:
    with pytest.raises(GeometryError, match=match):
        build_descriptor_table(srcs, dsts, sizes)


def test_launcher_rejects_bad_arguments() -> None:
    with pytest.raises(GeometryError, match="chunk_bytes"):
        build_descriptor_table([16], [32], [8], chunk_bytes=100)
    with pytest.raises(GeometryError, match="max_programs"):
        copy_pages([16], [32], [8], device=KERNEL_DEVICE, max_programs=0)
    with pytest.raises(GeometryError, match=r"int64 \[3, num_items\]"):
        launch_copy_pages(torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(GeometryError, match="contiguous"):
        launch_copy_pages(torch.zeros(3, 3, dtype=torch.int64).t())


# ------------------------------------------------------------------ cost model

#: (tensors, page bytes) of the swap benchmark's geometries: Qwen2.5-0.5B, Llama-3-8B, DeepSeek MLA.
GEOMETRIES = [(48, 4096), (64, 32768), (61, 41984)]
SIZES = [64, 576, 4096, 32768, 262144, 1 << 20, 1 << 24]
COUNTS = [1, 2, 5, 10, 20, 50, 100, 1000, 10_000, 100_000]


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("page_bytes", SIZES)
def test_choice_is_monotone_in_descriptor_count(direction: Direction, page_bytes: int) -> None:
    # At a fixed page size, more descriptors never turn a kernel choice back into DMA.
    choices = [kernel_or_batch(n, n * page_bytes, direction) for n in COUNTS]
    assert choices == sorted(choices)  # "batch" < "kernel": all batches first, then kernels


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("count", COUNTS)
def test_choice_is_monotone_in_page_size(direction: Direction, count: int) -> None:
    # At a fixed count, larger pages never turn DMA back into the kernel (registered-memory DMA at
    # 55 GB/s beats the kernel's ~50 GB/s on large pages in both directions).
    choices = [kernel_or_batch(count, count * s, direction) for s in SIZES]
    assert choices == sorted(choices, reverse=True)  # all kernels first, then batches
    assert choices[-1] == "batch"


def test_thresholds_of_the_default_calibration() -> None:
    calib = Calibration()
    # The H200 fit of 2026-11-29 (docs/copy-kernel.md).
    assert (calib.batch_d2h_us_per_descriptor, calib.batch_h2d_us_per_descriptor) == (0.60, 1.47)
    assert calib == Calibration.from_dict(attrs.asdict(calib))
    # A lone small page: the kernel's ~110 us fixed cost loses to one driver descriptor.
    assert kernel_or_batch(1, 4096, Direction.H2D) == "batch"
    assert kernel_or_batch(0, 0, "d2h") == "batch"
    # 4 KiB pages, step costs (copy x (1 + slowdown)): out of the GPU
    # 1.003 (10 + 0.6743 n) > 1.1 * 1.052 (110 + 0.0868 n) from 204 descriptors on,
    # into it 1.003 (10 + 1.544 n) > 1.1 * 1.056 (110 + 0.0859 n) from 82 on.
    assert kernel_or_batch(203, 203 * 4096, Direction.D2H) == "batch"
    assert kernel_or_batch(204, 204 * 4096, Direction.D2H) == "kernel"
    assert kernel_or_batch(81, 81 * 4096, Direction.H2D) == "batch"
    assert kernel_or_batch(82, 82 * 4096, Direction.H2D) == "kernel"
    # Without compute to slow (copies alone) the kernel takes smaller batches.
    alone = Calibration(compute_overlap=0.0)
    assert kernel_or_batch(195, 195 * 4096, Direction.D2H, alone) == "kernel"
    # Large descriptors go to DMA in both directions, above ~110 KB out and ~270 KB in.
    for direction, low, high in ((Direction.D2H, 90e3, 130e3), (Direction.H2D, 240e3, 300e3)):
        cross = calib.crossover_bytes(direction)
        assert cross is not None and low < cross < high
        n = 100_000
        assert kernel_or_batch(n, int(n * cross * 0.9), direction) == "kernel"
        assert kernel_or_batch(n, int(n * cross * 1.1), direction) == "batch"
    # A DMA slower than the kernel on large copies leaves no crossover: the kernel wins always.
    assert Calibration(batch_h2d_gbps=31.0).crossover_bytes(Direction.H2D) is None


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize(("tensors", "page_bytes"), GEOMETRIES)
@pytest.mark.parametrize("blocks", [64, 512])
def test_benchmark_geometries_choose_the_kernel(direction, tensors, page_bytes, blocks) -> None:
    n = tensors * blocks  # scattered blocks: one descriptor per page
    assert kernel_or_batch(n, n * page_bytes, direction) == "kernel"


def test_kernel_or_batch_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="counts >= 0"):
        kernel_or_batch(-1, 0, Direction.D2H)
    with pytest.raises(ValueError, match="sideways"):
        kernel_or_batch(1, 1, "sideways")


def test_calibration_validates() -> None:
    with pytest.raises(ValueError, match="batch_d2h_gbps"):
        Calibration(batch_d2h_gbps=0.0)
    with pytest.raises(ConfigError, match="batch_h2d_us_per_descriptor"):
        Calibration(batch_h2d_us_per_descriptor=0.01, kernel_us_per_descriptor=0.05)
    with pytest.raises(ConfigError, match="unknown calibration fields"):
        Calibration.from_dict({"kernel_gbps": 3})
    with pytest.raises(ConfigError, match="invalid calibration"):
        Calibration.from_dict({"kernel_d2h_gbps": "fast"})


def test_calibration_from_json_shapes(tmp_path) -> None:
    fields = {"kernel_d2h_gbps": 47.5, "batch_d2h_us_per_descriptor": 0.8}
    expected = Calibration(**fields)
    # the older direction-blind field sets both directions; an explicit one wins
    legacy = Calibration.from_dict(
        {"batch_us_per_descriptor": 0.9, "batch_h2d_us_per_descriptor": 2}
    )
    assert (legacy.batch_d2h_us_per_descriptor, legacy.batch_h2d_us_per_descriptor) == (0.9, 2.0)
    path = tmp_path / "calib.json"
    path.write_text(json.dumps({"calibration": fields, "copies": []}))
    assert Calibration.from_json(path) == expected
    assert Calibration.from_json(str(path)) == expected
    assert Calibration.from_json(json.dumps(fields)) == expected
    assert Calibration.from_json(fields) == expected
    with pytest.raises(ConfigError, match="could not read"):
        Calibration.from_json(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="could not read"):
        Calibration.from_json("{not json")


def test_calibration_fit_recovers_a_known_model() -> None:
    # Rows generated from a known model with 1% multiplicative noise: the fit finds it again.
    truth = Calibration(
        batch_launch_us=12.0, batch_h2d_us_per_descriptor=1.7, batch_d2h_us_per_descriptor=0.7,
        batch_h2d_gbps=50.0, batch_d2h_gbps=53.0,
        kernel_launch_us=90.0, kernel_us_per_descriptor=0.004,
        kernel_h2d_gbps=44.0, kernel_d2h_gbps=49.0,
    )  # fmt: skip
    rng = np.random.default_rng(2)
    rows = []  # in the "copies" format of `kvmgr bench swap --json`
    for (tensors, page), blocks, direction in zip(
        GEOMETRIES * 4, [64, 512] * 6, [Direction.H2D] * 6 + [Direction.D2H] * 6
    ):
        n = tensors * blocks
        for variant, model in (("batch_ctypes", truth.batch_us), ("kernel", truth.kernel_us)):
            us = model(n, n * page, direction) * (1 + 0.01 * rng.standard_normal())
            row = {"variant": variant, "direction": direction.value, "descriptors": n}
            rows.append({**row, "bytes": n * page, "us": us, "gbps": n * page / us / 1e3})
    rows.append({"variant": "loop", "direction": "h2d", "descriptors": 1, "bytes": 1, "us": 9e6})
    # DMA bandwidth comes from the registered-memory peak rows; cudaHostAlloc rows are ignored.
    peak = [
        {"memory": "registered", "direction": "h2d", "gbps": 50.0},
        {"memory": "registered", "direction": "d2h", "gbps": 53.0},
        {"memory": "cudaHostAlloc", "direction": "d2h", "gbps": 99.0},
    ]
    data = {"info": {}, "peak": peak, "copies": rows}
    fitted = Calibration.fit(rows, Calibration(batch_launch_us=12.0), peak_rows=peak)
    for name in (
        "batch_h2d_us_per_descriptor",
        "batch_d2h_us_per_descriptor",
        "kernel_h2d_gbps",
        "kernel_d2h_gbps",
    ):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    assert (fitted.batch_h2d_gbps, fitted.batch_d2h_gbps) == (50.0, 53.0)
    assert fitted.kernel_margin == truth.kernel_margin
    # from_json fits the "copies" of a `kvmgr bench swap` file the same way (default launch)
    assert Calibration.from_json(data).batch_d2h_gbps == 53.0
    # Too few kernel rows and no batch rows: everything keeps the base values.
    kernel_rows = [r for r in rows if r["variant"] == "kernel"]
    assert Calibration.fit(kernel_rows[:3]) == Calibration()
    with pytest.raises(ConfigError, match="descriptors, bytes, us"):
        Calibration.fit([{"variant": "kernel", "direction": "h2d"}])


# ------------------------------------------------------------------ engines without a GPU


def test_engine_arguments_are_checked_before_touching_cuda() -> None:
    with pytest.raises(ConfigError, match="max_programs"):
        CopyKernelEngine(max_programs=0)
    with pytest.raises(ConfigError, match="chunk_bytes"):
        CopyKernelEngine(chunk_bytes=1000)
    with pytest.raises(ConfigError, match="Calibration"):
        AutoEngine(calibration={"kernel_margin": 2})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_engines_without_a_gpu_raise_a_clear_error() -> None:
    for engine in (CopyKernelEngine, AutoEngine):
        with pytest.raises(TransferError, match="needs a CUDA device"):
            engine()


def test_library_never_imports_the_benchmarks() -> None:
    # benchmarks import the library, never the reverse (issue 12, layout)
    import ast
    import pathlib

    root = pathlib.Path(cuda_engine.__file__).parents[1]
    offenders = []
    for path in root.rglob("*.py"):
        if "bench" in path.relative_to(root).parts or path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("kvmgr.bench")]
    assert offenders == []


# ------------------------------------------------------------------ engines on fake CUDA


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> KernelFakeCuda:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("fake CUDA runs the copy kernel under the Triton interpreter (CPU only)")
    return KernelFakeCuda().install(monkeypatch)


def _cpu_kv(rng: np.random.Generator, page_sizes: list[int], num_blocks: int) -> list[torch.Tensor]:
    return [
        torch.from_numpy(rng.integers(0, 256, (num_blocks, p), dtype=np.uint8)) for p in page_sizes
    ]


def _scattered(rng, direction, page_sizes, num_pairs):
    """Random source tensors, poisoned destination tensors and a plan between scattered blocks."""
    src = _cpu_kv(rng, page_sizes, 2 * num_pairs)
    dst = [torch.full((num_pairs + 3, p), POISON, dtype=torch.uint8) for p in page_sizes]
    src_ids, dst_ids = 2 * rng.permutation(num_pairs), rng.permutation(num_pairs + 3)[:num_pairs]
    plan = build_plan(
        direction, KVLayout.from_tensors(src), KVLayout.from_tensors(dst), src_ids, dst_ids
    )
    return plan, src, dst, src_ids, dst_ids


def _cpu_pages(tensors: list[torch.Tensor], ids) -> list[torch.Tensor]:
    return [t[torch.as_tensor(np.array(ids, dtype=np.int64))] for t in tensors]


def test_kernel_engine_keeps_the_dma_engines_ordering(fake_cuda: KernelFakeCuda) -> None:
    rng = np.random.default_rng(21)
    engine = CopyKernelEngine(driver=FakeDriver(fake_cuda.log), warmup=False, max_programs=3)
    with engine:
        # a store of 584 B pages, then a load that must wait for it
        store, src, dst, src_ids, dst_ids = _scattered(rng, Direction.D2H, [584, 4096], 6)
        first = engine.submit(store)
        load, *_ = _scattered(rng, Direction.H2D, [1152], 4)
        fake_cuda.log.clear()
        second = engine.submit(load, wait_for=[first])
        h2d, fence = engine.stream(Direction.H2D), fake_cuda.log[0][1]
        assert [e if e[0] == "paged" else (e[0], e[2]) for e in fake_cuda.log] == [
            ("record", fake_cuda.compute),  # fence on the compute stream
            ("wait", fence),  # the copy stream waits on it (rules 3, 4)
            ("wait", first.end_event),  # and on the batch it depends on
            ("record", h2d),  # start event
            ("paged", 4, 3),  # one paged launch for the plan (4 runs x 1 tensor), 3 programs
            ("record", h2d),  # end event
        ]
        result = first.future.result(timeout=5)
        assert (result.path, result.num_bytes, result.device_s) == (
            "kernel",
            store.num_bytes,
            0.00025,
        )
        assert _same(_cpu_pages(dst, dst_ids), _cpu_pages(src, src_ids))
        assert second.future.result(timeout=5).path == "kernel"
    stats = engine.statistics()
    assert (stats.path, stats.kernel_batches, stats.dma_batches, stats.max_programs) == (
        "kernel",
        2,
        0,
        (3, 3),
    )
    assert (stats.batches_completed, stats.bytes_d2h, stats.bytes_h2d) == (
        2,
        store.num_bytes,
        load.num_bytes,
    )


def test_kernel_table_lives_until_the_end_event_then_is_reused(fake_cuda: KernelFakeCuda) -> None:
    rng = np.random.default_rng(22)
    with CopyKernelEngine(driver=FakeDriver(fake_cuda.log), warmup=False) as engine:
        slots = engine.issuer.kernel.slots
        plan, *_ = _scattered(rng, Direction.D2H, [656], 5)
        hold_two_tables(fake_cuda, engine, slots, plan)
        # both ended: their tables are back in the pool, and the next batch allocates nothing
        plan, src, dst, src_ids, dst_ids = _scattered(rng, Direction.D2H, [656], 7)
        engine.submit(plan).future.result(timeout=5)
        assert slots.num_allocated == 2
        assert _same(_cpu_pages(dst, dst_ids), _cpu_pages(src, src_ids))


def test_auto_engine_chooses_per_batch(
    fake_cuda: KernelFakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(23)
    asked: list[tuple[int, int]] = []

    def counting_kernel_or_batch(n: int, num_bytes: int, *args: Any) -> str:
        asked.append((n, num_bytes))
        return cost_model.kernel_or_batch(n, num_bytes, *args)

    monkeypatch.setattr(auto, "kernel_or_batch", counting_kernel_or_batch)
    with AutoEngine(driver=FakeDriver(fake_cuda.log), warmup=False) as engine:
        # one page: the launch costs more than one descriptor -> DMA
        one, src1, dst1, s1, d1 = _scattered(rng, Direction.H2D, [4096], 1)
        # 96 scattered pages of 4 KiB into the GPU (above the 77-page threshold) -> the kernel
        many, src2, dst2, s2, d2 = _scattered(rng, Direction.H2D, [4096], 96)
        fake_cuda.log.clear()
        paths = [engine.submit(p).future.result(timeout=5).path for p in (one, many)]
        assert paths == ["batch", "kernel"]
        assert [e[0] for e in fake_cuda.log if e[0] in ("dma", "paged")] == ["dma", "paged"]
        # the model is asked once per batch, with the plan's counts
        assert asked == [(p.num_descriptors, p.num_bytes) for p in (one, many)]
        assert _same(_cpu_pages(dst1, d1), _cpu_pages(src1, s1))
        assert _same(_cpu_pages(dst2, d2), _cpu_pages(src2, s2))
        stats = engine.statistics()
    assert (stats.path, stats.kernel_batches, stats.dma_batches) == ("auto", 1, 1)
    assert 0 < stats.issue_s < stats.submit_s  # host time of the driver call and the launch


def test_plans_from_build_plan_take_the_paged_path_and_others_the_descriptors(
    fake_cuda: KernelFakeCuda,
) -> None:
    rng = np.random.default_rng(28)
    pages = [576, 584, 4096]
    # the GPU side holds K and V halves: its tensors are strided, the CPU side is dense
    gpu_full = [torch.from_numpy(rng.integers(1, 256, (64, 2, p), dtype=np.uint8)) for p in pages]
    gpu = [t[:, 0] for t in gpu_full]
    cpu = [torch.full((80, p), POISON, dtype=torch.uint8) for p in pages]
    gpu_layout, cpu_layout = KVLayout.from_tensors(gpu), KVLayout.from_tensors(cpu)
    # a run of 20 consecutive blocks (split at 2 blocks per item: chunk_bytes 8 KiB) + scattered
    gpu_ids = np.r_[np.arange(30, 50), rng.choice(30, 12, replace=False)]
    cpu_ids = np.r_[np.arange(5, 25), rng.choice(np.arange(30, 80), 12, replace=False)]
    engine = CopyKernelEngine(
        driver=FakeDriver(fake_cuda.log), warmup=False, max_programs=3, chunk_bytes=8192
    )
    with engine:
        kernel_copy = engine.issuer.kernel
        plan = build_plan(Direction.D2H, gpu_layout, cpu_layout, gpu_ids, cpu_ids)
        fake_cuda.log.clear()
        result = engine.submit(plan).future.result(timeout=5)
        # 13 runs (20 consecutive blocks + 12 scattered) become 10 + 12 rows, x 3 tensors
        assert [e for e in fake_cuda.log if e[0] in ("kernel", "paged")] == [("paged", 66, 3)]
        assert (result.path, result.num_bytes) == ("kernel", 32 * sum(pages))
        assert plan._built is None  # the descriptors were never built
        assert _same(_cpu_pages(cpu, cpu_ids), _cpu_pages(gpu, gpu_ids))
        untouched = np.setdiff1d(np.arange(80), cpu_ids)
        assert all(bool((p == POISON).all()) for p in _cpu_pages(cpu, untouched))
        # the same layouts again: the layout table is not uploaded again
        (layout_table,) = kernel_copy.stager._layouts.values()
        again = build_plan(Direction.D2H, gpu_layout, cpu_layout, gpu_ids[::-1], cpu_ids[::-1])
        engine.submit(again).future.result(timeout=5)
        assert list(kernel_copy.stager._layouts.values()) == [layout_table]
        # hand-made, edited or split plans: the descriptor table
        for other, whole in (
            (TransferPlan(Direction.D2H, plan.src_addrs, plan.dst_addrs, plan.sizes), True),
            (attrs.evolve(plan, sizes=plan.sizes.copy()), True),  # counts match: still edited
            (plan.split(plan.num_descriptors - 1)[0], False),
        ):
            for t in cpu:
                t.fill_(POISON)
            fake_cuda.log.clear()
            assert engine.submit(other).future.result(timeout=5).path == "kernel"
            assert [e[0] for e in fake_cuda.log if e[0] in ("kernel", "paged")] == ["kernel"]
            assert not whole or _same(_cpu_pages(cpu, cpu_ids), _cpu_pages(gpu, gpu_ids))
        engine.submit(plan).future.result(timeout=5)  # the whole store again, paged
        # a load back into other GPU blocks, paged with its own layout table
        back = np.setdiff1d(np.arange(64), gpu_ids)[:32]
        for t in gpu:
            t[torch.as_tensor(back)] = POISON
        v_halves = [t[:, 1].clone() for t in gpu_full]
        load = build_plan(Direction.H2D, cpu_layout, gpu_layout, cpu_ids, back)
        fake_cuda.log.clear()
        engine.submit(load).future.result(timeout=5)
        assert _same([t[:, 1] for t in gpu_full], v_halves)  # between the strided pages: untouched
        assert [e[0] for e in fake_cuda.log if e[0] in ("kernel", "paged")] == ["paged"]
        assert len(kernel_copy.stager._layouts) == 2
        assert _same(_cpu_pages(gpu, back), _cpu_pages(gpu, gpu_ids))


def test_paged_path_only_for_layouts_the_kernel_can_address() -> None:
    copy = kernel.KernelCopy(torch.device("cuda", 0), FakeDriver([]))  # type: ignore[arg-type]

    def layout(device: str) -> KVLayout:
        one = np.array([4096], dtype=np.int64)
        return KVLayout(one, one, one, 4, torch.device(device))

    cpu, gpu, other, meta = (layout(d) for d in ("cpu", "cuda:0", "cuda:1", "meta"))
    for _ in range(2):  # the second answer comes from the cache of pairs
        assert copy._addressable(cpu, gpu) and copy._addressable(gpu, cpu)
        assert not copy._addressable(cpu, other) and not copy._addressable(meta, gpu)


def test_a_refused_layout_upload_fails_its_batch_only(fake_cuda: KernelFakeCuda) -> None:
    class RefusingDriver(FakeDriver):
        refuse = 1

        def memcpy(self, dst: int, src: int, num_bytes: int, stream: int) -> None:
            if self.refuse:
                self.refuse -= 1
                raise TransferError("upload refused")
            super().memcpy(dst, src, num_bytes, stream)

    rng = np.random.default_rng(29)
    with CopyKernelEngine(driver=RefusingDriver(fake_cuda.log), warmup=False) as engine:
        plan, src, dst, src_ids, dst_ids = _scattered(rng, Direction.D2H, [576], 3)
        with pytest.raises(TransferError, match="layout upload failed: upload refused"):
            engine.submit(plan).future.result(timeout=5)
        assert engine.issuer.kernel.stager._layouts == {}  # not cached: the next batch uploads it
        assert engine.submit(plan).future.result(timeout=5).path == "kernel"
        assert _same(_cpu_pages(dst, dst_ids), _cpu_pages(src, src_ids))


def test_a_failed_launch_fails_its_batch_only(fake_cuda: KernelFakeCuda) -> None:
    rng = np.random.default_rng(24)
    with CopyKernelEngine(driver=FakeDriver(fake_cuda.log), warmup=False) as engine:
        fake_cuda.fail_launches = 1
        plan, *_ = _scattered(rng, Direction.D2H, [576], 3)
        with pytest.raises(
            TransferError, match="batch 0: copy kernel launch failed: launch refused"
        ):
            engine.submit(plan).future.result(timeout=5)
        plan, src, dst, src_ids, dst_ids = _scattered(rng, Direction.D2H, [576], 3)
        assert engine.submit(plan).future.result(timeout=5).path == "kernel"
        assert _same(_cpu_pages(dst, dst_ids), _cpu_pages(src, src_ids))
        with pytest.raises(GeometryError, match="sizes >= 0"):
            engine.submit(attrs.evolve(plan, sizes=-plan.sizes))
    stats = engine.statistics()
    assert (stats.batches_failed, stats.batches_completed, stats.batches_submitted) == (1, 1, 2)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="registration really works where CUDA is present"
)
def test_pageable_host_memory_sends_every_batch_to_dma(fake_cuda: KernelFakeCuda) -> None:
    rng = np.random.default_rng(25)
    with CopyKernelEngine(
        driver=FakeDriver(fake_cuda.log), warmup=False, allow_pageable=True
    ) as engine:
        engine.allocate_host(8192)  # registration fails without CUDA: pageable
        plan, src, dst, src_ids, dst_ids = _scattered(rng, Direction.D2H, [4096], 40)
        assert engine.submit(plan).future.result(timeout=5).path == "batch"
        assert _same(_cpu_pages(dst, dst_ids), _cpu_pages(src, src_ids))
        stats = engine.statistics()
    assert (stats.host_memory, stats.kernel_batches, stats.dma_batches) == ("pageable", 0, 1)


def test_without_triton_kernel_fails_clearly_and_auto_uses_dma(
    fake_cuda: KernelFakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cuda_engine, "KERNEL_AVAILABLE", False)
    with pytest.raises(TransferError, match="needs Triton"):
        CopyKernelEngine(driver=FakeDriver(fake_cuda.log))
    rng = np.random.default_rng(26)
    with AutoEngine(driver=FakeDriver(fake_cuda.log)) as engine:
        plan, src, dst, src_ids, dst_ids = _scattered(rng, Direction.D2H, [4096], 40)
        assert engine.submit(plan).future.result(timeout=5).path == "batch"
        assert _same(_cpu_pages(dst, dst_ids), _cpu_pages(src, src_ids))
    assert (engine.statistics().kernel_batches, engine.statistics().dma_batches) == (0, 1)


def test_auto_engine_falls_back_to_dma_when_the_warmup_copy_fails(
    fake_cuda: KernelFakeCuda, caplog: pytest.LogCaptureFixture
) -> None:
    # On fake CUDA the warm-up's device tensors cannot be created: "kernel" raises, "auto" logs.
    with pytest.raises(TransferError, match="warm-up copy"):
        CopyKernelEngine(driver=FakeDriver(fake_cuda.log))
    rng = np.random.default_rng(27)
    with caplog.at_level("WARNING"), AutoEngine(driver=FakeDriver(fake_cuda.log)) as engine:
        plan, *_ = _scattered(rng, Direction.H2D, [4096], 40)
        assert engine.submit(plan).future.result(timeout=5).path == "batch"
    assert "copy kernel unusable" in caplog.text and engine.statistics().kernel_batches == 0


def test_launcher_without_triton_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmgr.kernels.copy import pages as module

    monkeypatch.setattr(module, "KERNEL_AVAILABLE", False)
    with pytest.raises(TransferError, match="needs Triton"):
        launch_copy_pages(torch.ones(3, 1, dtype=torch.int64))


# ------------------------------------------------------------------ GPU engines


def _gpu_kv(seed: int, page_sizes: list[int], num_blocks: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randint(0, 256, (num_blocks, page), dtype=torch.uint8, device="cuda", generator=gen)
        for page in page_sizes
    ]


def _host_kv(engine, page_sizes: list[int], num_blocks: int) -> list[torch.Tensor]:
    """Poisoned views of one pinned region: ``uint8 [num_blocks, page]`` per tensor."""
    flat = engine.allocate_host(num_blocks * sum(page_sizes)).fill_(POISON)
    views, offset = [], 0
    for page in page_sizes:
        views.append(flat[offset : offset + num_blocks * page].view(num_blocks, page))
        offset += num_blocks * page
    return views


def _pages(tensors: list[torch.Tensor], ids) -> list[torch.Tensor]:
    # np.array copies: torch rejects numpy views with negative strides (ids[::-1]).
    index = torch.as_tensor(np.array(ids, dtype=np.int64))
    return [t[index.to(t.device)].cpu() for t in tensors]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _make(name: str, **kwargs):
    return (CopyKernelEngine if name == "kernel" else AutoEngine)(**kwargs)


def _expected_path(engine, plan) -> str:
    """What the engine must choose: always the kernel, or auto's cost model."""
    if not isinstance(engine, AutoEngine):
        return "kernel"
    return kernel_or_batch(plan.num_descriptors, plan.num_bytes, plan.direction, engine.calibration)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["kernel", "auto"])
@pytest.mark.parametrize(
    "page_sizes", [[4096] * 6, [32768] * 2, [1152] * 4, [584] * 6, [584, 4096, 1152, 32768, 656]]
)
def test_gpu_round_trip_random_pages(name: str, page_sizes: list[int]) -> None:
    engine = _make(name)
    try:
        gpu, host = _gpu_kv(sum(page_sizes), page_sizes, 40), _host_kv(engine, page_sizes, 48)
        gpu_layout, host_layout = KVLayout.from_tensors(gpu), KVLayout.from_tensors(host)
        # store: a run of four blocks (merged) and scattered ones
        rng = np.random.default_rng(len(page_sizes))
        gpu_ids = np.r_[[3, 4, 5, 6], rng.choice(np.arange(10, 40), 20, replace=False)]
        cpu_ids = np.r_[[10, 11, 12, 13], rng.choice(np.r_[0:10, 14:48], 20, replace=False)]
        store = build_plan(Direction.D2H, gpu_layout, host_layout, gpu_ids, cpu_ids)
        result = engine.submit(store).future.result(timeout=60)
        assert result.num_bytes == 24 * sum(page_sizes) and result.device_s > 0
        assert result.path == _expected_path(engine, store)
        assert _same(_pages(host, cpu_ids), _pages(gpu, gpu_ids))
        untouched = np.setdiff1d(np.arange(48), cpu_ids)
        assert all(bool((p == POISON).all()) for p in _pages(host, untouched))
        # load into other GPU blocks, poisoned on the compute stream right before the submit
        expected = _pages(gpu, gpu_ids)
        back = rng.permutation(40)[:24]
        for t in gpu:
            t[torch.as_tensor(back, device="cuda")] = POISON
        load_plan = build_plan(Direction.H2D, host_layout, gpu_layout, cpu_ids, back)
        load = engine.submit(load_plan)
        engine.stream_wait(load)
        assert _same(_pages(gpu, back), expected)
        assert load.future.result(timeout=60).path == _expected_path(engine, load_plan)
        stats = engine.statistics()
        kernels = [_expected_path(engine, p) for p in (store, load_plan)].count("kernel")
        assert (stats.path, stats.kernel_batches, stats.dma_batches) == (name, kernels, 2 - kernels)
        assert stats.bytes_d2h == stats.bytes_h2d == result.num_bytes
    finally:
        engine.close()


@pytest.mark.gpu
def test_gpu_store_right_after_a_kernel_sees_the_final_bytes() -> None:
    engine = CopyKernelEngine(max_programs=2)
    try:
        gpu, host = _gpu_kv(3, [32768] * 4, 32), _host_kv(engine, [32768] * 4, 32)
        ids = torch.tensor([2, 9, 10, 31], device="cuda")
        torch.cuda._sleep(100_000_000)  # keep the compute stream busy (~50 ms)
        for t in gpu:
            t.index_fill_(0, ids, 0x3C)  # written after the sleep; the store must wait for it
        plan = build_plan(
            Direction.D2H,
            KVLayout.from_tensors(gpu),
            KVLayout.from_tensors(host),
            ids.cpu(),
            [0, 1, 5, 6],
        )
        engine.submit(plan).future.result(timeout=60)
        assert all(bool((p == 0x3C).all()) for p in _pages(host, [0, 1, 5, 6]))
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("skews", [(0, 8), (1, 2), (4, 12)])
def test_gpu_kernel_copies_between_pinned_host_and_device(skews: tuple[int, int]) -> None:
    # The kernel dereferences pinned host addresses directly (device pointer == host pointer).
    rng = np.random.default_rng(sum(skews))
    src, dst, srcs, dsts, n = _plan(rng, ODD_SIZES, skews, "cuda")
    # GPU -> host: the destination mirrored into pinned memory at the same offsets
    host_dst = dst.cpu().pin_memory()
    host_dsts = host_dst.data_ptr() + (dsts - dst.data_ptr())
    expected = _expected(src, host_dst, srcs, host_dsts, n)
    _run(srcs, host_dsts, n)
    assert torch.equal(host_dst, expected)
    # host -> GPU
    host_src = src.cpu().pin_memory()
    host_srcs = host_src.data_ptr() + (srcs - src.data_ptr())
    expected = _expected(host_src, dst, host_srcs, dsts, n)
    _run(host_srcs, dsts, n)
    assert torch.equal(dst, expected)


@pytest.mark.gpu
def test_gpu_auto_uses_dma_for_large_runs_and_the_kernel_for_small_pages() -> None:
    engine = AutoEngine()
    try:
        big, small = [256 << 10], [4096] * 8
        gpu_big, host_big = _gpu_kv(5, big, 64), _host_kv(engine, big, 64)
        gpu_small, host_small = _gpu_kv(6, small, 64), _host_kv(engine, small, 64)
        # 64 consecutive blocks of 256 KiB merge into one 16 MiB descriptor: DMA out of the GPU.
        run = build_plan(
            Direction.D2H,
            KVLayout.from_tensors(gpu_big),
            KVLayout.from_tensors(host_big),
            np.arange(64),
            np.arange(64),
        )
        assert run.num_descriptors == 1
        assert kernel_or_batch(1, run.num_bytes, Direction.D2H, engine.calibration) == "batch"
        # 48 scattered blocks x 8 tensors of 4 KiB: 384 descriptors, the kernel.
        ids = np.random.default_rng(6).permutation(64)[:48]
        pages = build_plan(
            Direction.D2H,
            KVLayout.from_tensors(gpu_small),
            KVLayout.from_tensors(host_small),
            ids,
            ids[::-1],
        )
        first, second = engine.submit(run), engine.submit(pages)
        assert first.future.result(timeout=60).path in ("batch", "loop")
        assert second.future.result(timeout=60).path == "kernel"
        assert _same(_pages(host_big, np.arange(64)), _pages(gpu_big, np.arange(64)))
        assert _same(_pages(host_small, ids[::-1]), _pages(gpu_small, ids))
        stats = engine.statistics()
        assert (stats.kernel_batches, stats.dma_batches, stats.batches_failed) == (1, 1, 0)
    finally:
        engine.close()


def test_the_cost_model_charges_the_compute_a_copy_slows() -> None:
    calib = Calibration()
    for direction in Direction:
        n, num_bytes = 24_576, 24_576 * 4096
        kernel_us = calib.kernel_us(n, num_bytes, direction)
        # the kernel pays ~5% of its copy time in slowed compute, the DMA batch ~0.3%
        assert 1.05 * kernel_us < calib.kernel_step_us(n, num_bytes, direction) < 1.06 * kernel_us
        batch_us = calib.batch_us(n, num_bytes, direction)
        assert calib.batch_step_us(n, num_bytes, direction) == pytest.approx(1.003 * batch_us)
    # a costly kernel (32 programs D2H: 58%) loses mid-sized batches it would win on copy time
    greedy = Calibration(kernel_d2h_slowdown=0.58)
    assert (
        kernel_or_batch(300, 300 * 4096, Direction.D2H, Calibration(compute_overlap=0)) == "kernel"
    )
    assert kernel_or_batch(300, 300 * 4096, Direction.D2H, greedy) == "batch"
    with pytest.raises(ValueError):
        Calibration(compute_overlap=1.5)


def test_table_slots_come_in_size_classes_and_are_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "new_table_slot", cpu_table_slot)
    slots = staging.TableSlots(torch.device("cpu"))
    small, large = slots.take(10), slots.take(5000)
    assert (small.capacity, large.capacity, slots.num_allocated) == (4096, 8192, 2)
    slots.give(small)
    assert slots.take(4096) is small and slots.num_allocated == 2
    assert slots.take(100) is not small and slots.num_allocated == 3  # small is taken


def test_engines_registry_names_the_engines() -> None:
    from kvmgr.transfer import ENGINES

    assert list(ENGINES) == ["host", "cuda", "kernel", "auto"]


def test_calibration_fit_takes_the_slowdowns_from_interference_rows() -> None:
    rows = [
        {"variant": "kernel", "direction": "d2h", "slowdown_pct": 5.2},
        {"variant": "kernel", "direction": "h2d", "slowdown_pct": 5.6},
        {"variant": "kernel@32", "direction": "d2h", "slowdown_pct": 58.1},  # not the default cap
        {"variant": "batch", "direction": "d2h", "slowdown_pct": 0.4},
        {"variant": "batch", "direction": "h2d", "slowdown_pct": -0.2},  # noise: counts as 0
    ]
    calib = Calibration.fit([], interference_rows=rows)
    assert (calib.kernel_d2h_slowdown, calib.kernel_h2d_slowdown) == pytest.approx((0.052, 0.056))
    assert calib.batch_slowdown == pytest.approx(0.002)
    with pytest.raises(ConfigError, match="slowdown_pct"):
        Calibration.fit([], interference_rows=[{"variant": "kernel", "direction": "d2h"}])
