"""Round 4, session 5: what a fresh user hit with bad input, one regression test per finding.

1. Block ids that are not a sequence (a generator, a dict, a set, a memoryview) raise
   ``InvalidBlockError`` on every call that takes ids (more cases in tests/test_bad_input.py).
2. A block id beyond the int64 range (a uint64 id >= 2**63, a Python int) is named in the
   message with the pool's valid range, instead of the negative id it wrapped to.
3. An empty parent key ``b""`` is refused like an empty key (one key rule, ``kvmgr._keys``).
4. ``close`` / ``aclose`` / ``drain_tiers`` / ``wait`` refuse a negative, NaN, infinite or
   non-number ``timeout_s`` with ``InvalidArgumentError`` before anything closes (one rule,
   ``kvmgr.manager.core.check_timeout``).
5. ``gpu_kv_caches`` that is not a sequence of tensors (one tensor, a dict, a generator) raises
   ``GeometryError`` before anything is built (one tensor used to be split into one "layer"
   per block); ``GroupedManager.create`` too.
6. Layerwise calls with a bad layer argument (``layers`` of floats, strings, a generator, a
   dict, nested lists; a float or NaN ``min_group_bytes``; a float ``max_groups``, also when an
   equal int was cached; ``save_layer`` of a layer outside the store) raise ``LayerOrderError``
   with a message naming the bad value, before anything is queued.
7. ``GroupedManager.store`` / ``load`` with bad GPU ids in one group (out of range, repeated,
   not held in an owned pool) raise ``InvalidBlockError`` naming the group before ANY group's
   swap is queued (the groups before it used to be queued and stored). Nearby: a group's
   table may be a 1-D numpy or torch array, or hold numpy ints, as ``OffloadManager`` takes
   them (they were refused with ``GroupKeyError``).

Docs: README.md's module table names every package under ``kvmgr/`` and its bench row every
``kvmgr bench`` command (it listed 8 of 15 and missed five packages).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

from kvmgr.errors import InvalidBlockError
from kvmgr.pool.allocator import BlockAllocator
from kvmgr.pool.block_ids import as_id_array


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param(lambda: (i for i in [0]), id="generator"),
        pytest.param(lambda: iter([0]), id="iterator"),
        pytest.param(lambda: {0: 1}, id="dict"),
        pytest.param(lambda: {0}, id="set"),
        pytest.param(lambda: frozenset([0]), id="frozenset"),
        pytest.param(lambda: memoryview(b"\x00"), id="memoryview"),
        pytest.param(lambda: None, id="none"),
        pytest.param(lambda: 0, id="int"),
    ],
)
def test_block_ids_that_are_not_a_sequence_are_refused(ids: object) -> None:
    pool = BlockAllocator(4, name="cpu")
    held = pool.allocate(2)
    with pytest.raises(InvalidBlockError, match="expected a sequence of int block ids"):
        pool.free(ids())  # type: ignore[operator]
    with pytest.raises(InvalidBlockError, match="expected a sequence of int block ids"):
        pool.check_allocated(ids())  # type: ignore[operator]
    assert pool.num_allocated == 2 and pool.check_allocated(held) == held  # nothing freed


def test_sequences_and_integer_arrays_are_still_accepted() -> None:
    for ids in ([2, 0], (2, 0), range(2, -1, -2), np.array([2, 0], dtype=np.uint8)):
        assert as_id_array(ids, "gpu").tolist() == [2, 0]


@pytest.mark.parametrize(
    ("ids", "bad"),
    [
        pytest.param(np.array([1, 2**63], dtype=np.uint64), 2**63, id="uint64-2**63"),
        pytest.param(np.array([2**64 - 1], dtype=np.uint64), 2**64 - 1, id="uint64-max"),
        pytest.param([1, 2**63], 2**63, id="int-2**63"),
        pytest.param([-(2**63) - 1], -(2**63) - 1, id="int-below-int64"),
        pytest.param([np.uint64(2**63)], 2**63, id="np-uint64-scalar"),
    ],
)
def test_an_id_beyond_int64_is_named_with_the_valid_range(ids: object, bad: int) -> None:
    pool = BlockAllocator(8, name="gpu")
    pool.allocate(2)
    message = rf"^gpu block id {bad} out of range \[0, 8\)$"
    with pytest.raises(InvalidBlockError, match=message):
        pool.free(ids)  # type: ignore[arg-type]
    with pytest.raises(InvalidBlockError, match=message):
        as_id_array(ids, "gpu", 8)
    assert pool.num_allocated == 2


@pytest.mark.asyncio
async def test_a_huge_uint64_id_through_the_manager_names_the_id() -> None:
    from kvmgr import ManagerConfig, OffloadManager

    kv = [torch.randn(8, 16) for _ in range(2)]
    async with OffloadManager(kv, ManagerConfig(num_cpu_blocks=8, engine="host")) as mgr:
        mgr.allocate("r", 2)
        huge = np.array([0, 2**63 + 5], dtype=np.uint64)
        for call in (
            lambda: mgr.store_many(huge, [b"a" * 8, b"b" * 8]),
            lambda: mgr.load_many([b"a" * 8, b"b" * 8], huge),
        ):
            with pytest.raises(InvalidBlockError, match=rf"id {2**63 + 5} out of range \[0, 8\)"):
                call()
        assert mgr.statistics().queued_swaps == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("batched", [False, True], ids=["swap_out", "store_many"])
async def test_an_empty_parent_key_is_refused_like_an_empty_key(batched: bool) -> None:
    from kvmgr import InvalidKeyError, ManagerConfig, OffloadManager

    kv = [torch.randn(8, 16) for _ in range(2)]
    async with OffloadManager(kv, ManagerConfig(num_cpu_blocks=8, engine="host")) as mgr:
        ids = mgr.allocate("r", 2)
        keys = [b"a" * 8, b"b" * 8]
        store = mgr.store_many if batched else mgr.swap_out
        for parents in ([b"", keys[0]], [None, b""]):
            with pytest.raises(InvalidKeyError, match="non-empty bytes or None"):
                store(ids, keys, parents=parents)  # type: ignore[operator]
        with pytest.raises(InvalidKeyError, match="non-empty bytes"):
            store(ids, [b"", keys[1]])  # type: ignore[operator]
        assert mgr.statistics().queued_swaps == 0 and mgr.peek(keys) == 0
        future = store(ids, keys, parents=[None, keys[0]])  # type: ignore[operator]
        await mgr.step()
        await future
        assert mgr.peek(keys) == 2


BAD_TIMEOUTS = [-1, -0.5, float("nan"), float("inf"), "1", True, [1]]


@pytest.mark.asyncio
@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=repr)
async def test_a_bad_close_timeout_raises_before_anything_closes(timeout: object) -> None:
    from kvmgr import InvalidArgumentError, ManagerConfig, OffloadManager

    kv = [torch.randn(8, 16) for _ in range(2)]
    mgr = OffloadManager(kv, ManagerConfig(num_cpu_blocks=8, engine="host"))
    async with mgr:
        ids = mgr.allocate("r", 1)
        queued = mgr.swap_out(ids, [b"a" * 8])
        for call in (mgr.close, mgr.aclose, mgr.drain_tiers):
            with pytest.raises(InvalidArgumentError, match="timeout_s"):
                result = call(timeout)  # type: ignore[arg-type]
                if result is not None:
                    await result
            assert not mgr.closed and not queued.done()  # the queued store was not failed
        with pytest.raises(InvalidArgumentError, match="timeout_s"):
            await mgr.wait(queued, timeout)  # type: ignore[arg-type]
        await mgr.step()
        await queued
        assert mgr.peek([b"a" * 8]) == 1  # the manager still works
    assert mgr.closed


@pytest.mark.asyncio
async def test_good_close_timeouts_still_close() -> None:
    from kvmgr import ManagerConfig, OffloadManager

    kv = [torch.randn(8, 16) for _ in range(2)]
    for timeout in (None, 0, 0.5, np.float64(1.0), np.int64(2)):
        mgr = OffloadManager(kv, ManagerConfig(num_cpu_blocks=8, engine="host"))
        async with mgr:
            await mgr.drain_tiers(timeout)  # type: ignore[arg-type]
            await mgr.aclose(timeout)  # type: ignore[arg-type]
        assert mgr.closed
        mgr.close(timeout)  # type: ignore[arg-type]  # idempotent


@pytest.mark.parametrize(
    "caches",
    [
        pytest.param(lambda t: t[0], id="one-tensor"),
        pytest.param(lambda t: {"k": t[0], "v": t[1]}, id="dict"),
        pytest.param(lambda t: (x for x in t), id="generator"),
        pytest.param(lambda t: None, id="none"),
        pytest.param(lambda t: "kv", id="str"),
    ],
)
def test_kv_caches_that_are_not_a_sequence_of_tensors_are_refused(caches: Any) -> None:
    from kvmgr import GeometryError, ManagerConfig, OffloadManager

    kv = [torch.randn(8, 16) for _ in range(2)]
    with pytest.raises(GeometryError, match="gpu_kv_caches: expected a sequence of KV tensors"):
        OffloadManager(caches(kv), ManagerConfig(num_cpu_blocks=4, engine="host"))
    OffloadManager(tuple(kv), ManagerConfig(num_cpu_blocks=4, engine="host")).close()


def test_grouped_create_refuses_one_tensor_for_a_group() -> None:
    from kvmgr import GeometryError
    from kvmgr.groups import GroupedLayout, GroupedManager, GroupSpec

    full = GroupSpec(name="full", kind="full", block_size=16, page_bytes=(64, 64))
    layout = GroupedLayout([full], hash_block_size=16)
    kv = torch.randint(0, 256, (2, 8, 64), dtype=torch.uint8)  # [K/V, blocks, page]: not a list
    with pytest.raises(GeometryError, match=r"one tensor: pass \[tensor\]"):
        GroupedManager.create(layout, {"full": kv}, {"full": 4})
    GroupedManager.create(layout, {"full": list(kv)}, {"full": 4})  # the same tensors as a list


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"layers": [0, 0.5, 1, 1]}, "expected int layers, got float", id="floats"),
        pytest.param({"layers": ["0", "0", "1", "1"]}, "got str", id="strings"),
        pytest.param({"layers": [0, None, 1, 1]}, "got NoneType", id="none-layer"),
        pytest.param({"layers": [[0, 0], [1, 1]]}, "got list", id="nested"),
        pytest.param({"layers": np.zeros((2, 2), dtype=np.int64)}, "got ndarray", id="2-D"),
        pytest.param({"layers": np.array([0.0, 0, 1, 1])}, "got float", id="float-array"),
        pytest.param({"layers": (i for i in [0, 0, 1, 1])}, "got generator", id="generator"),
        pytest.param({"layers": {0: 0, 1: 0, 2: 1, 3: 1}}, "got dict", id="dict"),
        pytest.param({"layers": True}, "got bool", id="bool"),
        pytest.param({"layers": 2.0}, "got float", id="float-k"),
        pytest.param({"layers": [0, 2**70, 1, 1]}, "without gaps", id="huge"),
        pytest.param({"layers": [-1, 0, 1, 2]}, "non-decreasing from 0", id="negative"),
        pytest.param({"layers": [0, 1, 0, 1]}, "non-decreasing from 0", id="out-of-order"),
        pytest.param({"min_group_bytes": float("nan")}, "min_group_bytes", id="nan-bytes"),
        pytest.param({"min_group_bytes": "64"}, "min_group_bytes", id="str-bytes"),
        pytest.param({"min_group_bytes": True}, "min_group_bytes", id="bool-bytes"),
        pytest.param({"max_groups": 2.0}, "max_groups", id="float-groups"),
    ],
)
def test_bad_layer_groupings_raise_layer_order_error(kwargs: dict[str, Any], match: str) -> None:
    from kvmgr import LayerOrderError
    from kvmgr.transfer.layer_groups import LayerGroups

    args = {"layers": None, "min_group_bytes": 0, "max_groups": None, **kwargs}
    with pytest.raises(LayerOrderError, match=match):
        LayerGroups.build([64, 64, 32, 32], **args)


@pytest.mark.asyncio
async def test_bad_layerwise_arguments_raise_before_anything_is_queued() -> None:
    from kvmgr import LayerOrderError, ManagerConfig, OffloadManager

    kv = [torch.randn(8, 2, 16) for _ in range(4)]  # K and V of 2 layers
    keys = [b"a" * 8, b"b" * 8]
    async with OffloadManager(kv, ManagerConfig(num_cpu_blocks=8, engine="host")) as mgr:
        src, dst = mgr.allocate("a", 2), mgr.allocate("b", 2)
        stored = mgr.store_many(src, keys)
        await mgr.step()
        await stored
        load = mgr.load_layerwise(keys, dst, layers=2, max_groups=2)  # cached by its arguments
        await mgr.step()
        await load
        # equal to the cached (2, 2) but not ints: refused all the same
        for kwargs in (
            {"layers": 2, "max_groups": 2.0},
            {"layers": 2.0},
            {"layers": [0.0, 0, 1, 1]},
        ):
            with pytest.raises(LayerOrderError):
                mgr.load_layerwise(keys, dst, **kwargs)  # type: ignore[arg-type]
            with pytest.raises(LayerOrderError):
                mgr.store_layerwise(dst, [b"c" * 8, b"d" * 8], **kwargs)  # type: ignore[arg-type]
        stats = mgr.statistics()
        assert stats.queued_swaps == 0 and stats.cpu_keys_loading == 0
        assert mgr.peek([b"c" * 8]) == 0
        store = mgr.store_layerwise(dst, [b"c" * 8, b"d" * 8], layers=2)
        for layer, match in ((-1, "not a layer of the store"), (2, "covers layers 0..1")):
            with pytest.raises(LayerOrderError, match=match):
                store.save_layer(layer)
        store.save_layer(0)
        store.save_layer(np.int64(1))  # type: ignore[arg-type]
        await mgr.step()
        await store


def _grouped(owned: bool) -> Any:
    """A grouped manager of a full group and a sliding-window group, 16 GPU blocks each."""
    from kvmgr import ManagerConfig
    from kvmgr.groups import GroupedLayout, GroupedManager, GroupSpec

    full = GroupSpec(name="full", kind="full", block_size=16, page_bytes=(64, 64))
    swa = GroupSpec(name="swa", kind="sliding_window", block_size=16, page_bytes=(32,), window=33)
    layout = GroupedLayout([full, swa], hash_block_size=16)
    gen = torch.Generator().manual_seed(11)
    kv = {
        g.name: [
            torch.randint(1, 256, (16, p), dtype=torch.uint8, generator=gen) for p in g.page_bytes
        ]
        for g in layout.groups
    }
    cfg = ManagerConfig(num_cpu_blocks=1, engine="host", manage_gpu_blocks=owned)
    mgr = GroupedManager.create(layout, kv, {"full": 16, "swa": 16}, cfg)
    return mgr, kv


def _hashes(n: int, salt: bytes) -> list[bytes]:
    import hashlib

    return [hashlib.blake2b(salt + bytes([i]), digest_size=16).digest() for i in range(n)]


def _nothing_queued(mgr: Any) -> bool:
    return all(m.statistics().queued_swaps == 0 for m in mgr.managers)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("owned", "swa_ids", "match"),
    [
        pytest.param(
            False, [4, 16], r"group 'swa': gpu block id 16 out of range \[0, 16\)", id="range"
        ),
        pytest.param(False, [4, -1], "group 'swa': gpu block id -1", id="negative"),
        pytest.param(False, [5, 5], "group 'swa': duplicate gpu block ids", id="repeated"),
        pytest.param(True, [0, 9], "group 'swa': gpu block 9 is FREE, not held", id="not-held"),
    ],
)
async def test_grouped_calls_check_every_groups_ids_before_queueing_any(
    owned: bool, swa_ids: list[int], match: str
) -> None:
    from kvmgr import InvalidBlockError

    mgr, kv = _grouped(owned)
    async with mgr:
        if owned:  # request "r" holds blocks 0..3 of each group
            for m in mgr.managers:
                m.allocate("r", 4)
        good = {"full": [0, 1], "swa": [2, 3]}
        hs = _hashes(2, b"a")
        # the full group comes first and its ids are good: it was queued and stored
        with pytest.raises(InvalidBlockError, match=match):
            mgr.store(hs, {"full": [0, 1], "swa": swa_ids})
        assert _nothing_queued(mgr) and mgr.index.num_held() == 0
        await mgr.step()
        assert all(m.statistics().cpu_blocks_used == 0 for m in mgr.managers)
        stored = mgr.store(hs, good)
        await mgr.step()
        await stored
        plan = mgr.lookup(hs)
        assert plan.num_tokens == 32
        before = {n: [t.clone() for t in ts] for n, ts in kv.items()}
        with pytest.raises(InvalidBlockError, match=match):
            mgr.load(plan, {"full": [2, 3], "swa": swa_ids})
        assert _nothing_queued(mgr)
        await mgr.step()
        for name, ts in kv.items():  # no group's load ran
            assert all(torch.equal(a, b) for a, b in zip(ts, before[name], strict=True))
        assert all(m.statistics().cpu_keys_loading == 0 for m in mgr.managers)


@pytest.mark.asyncio
async def test_grouped_store_with_one_groups_manager_closed_queues_nothing() -> None:
    from kvmgr import ClosedError

    mgr, _ = _grouped(False)
    async with mgr:
        mgr.managers[1].close()
        with pytest.raises(ClosedError):
            mgr.store(_hashes(2, b"c"), {"full": [0, 1], "swa": [2, 3]})
        assert _nothing_queued(mgr) and mgr.index.num_held() == 0


@pytest.mark.asyncio
async def test_grouped_tables_take_arrays_and_numpy_ints_like_the_manager() -> None:
    from kvmgr.groups import GroupKeyError

    mgr, kv = _grouped(False)
    async with mgr:
        hs = _hashes(2, b"n")
        with pytest.raises(
            GroupKeyError, match=r"block_tables\['swa'\]\[1\]: expected int or None"
        ):
            mgr.store(hs, {"full": [0, 1], "swa": [2, 3.0]})
        with pytest.raises(GroupKeyError, match="got set"):
            mgr.store(hs, {"full": {0, 1}})
        assert _nothing_queued(mgr)
        tables = {"full": np.array([0, 1]), "swa": [np.int64(2), np.int32(3)]}
        stored = mgr.store(hs, tables)
        await mgr.step()
        await stored
        plan = mgr.lookup(hs)
        assert plan.num_tokens == 32
        loaded = mgr.load(plan, {"full": torch.tensor([4, 5]), "swa": np.array([6, 7])})
        await mgr.step()
        await loaded
        assert all(torch.equal(t[[0, 1]], t[[4, 5]]) for t in kv["full"])
        assert all(torch.equal(t[3], t[7]) for t in kv["swa"])  # the window's last block


def test_readme_module_table_and_bench_list_match_the_tree_and_the_cli() -> None:
    from pathlib import Path

    from kvmgr import cli

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    table = readme[readme.index("| module | what |") :].split("\n\n")[0]
    packages = sorted(p.name for p in (root / "kvmgr").iterdir() if (p / "__init__.py").exists())
    missing = [p for p in packages if f"`kvmgr/{p}/`" not in table]
    assert not missing, f"README's module table lacks {missing}"
    bench_row = next(line for line in table.splitlines() if line.startswith("| `kvmgr/bench/`"))
    listed = re.findall(r"`([a-z0-9-]+)`", bench_row.split("NAME one of", 1)[1])
    assert listed == list(cli.BENCHES)
    assert set(cli.BENCH_HELP) == set(cli.BENCHES)
    for name in cli.COMMANDS:
        assert f"kvmgr {name}" in readme, name
