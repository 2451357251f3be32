"""``GroupedManager(layout, managers)`` with managers that are not a sequence of managers.

Round 4, session 13 (newuser14): a dict of managers by group name (what
``DeepSeekV4Offload(layout, managers)`` and ``GroupedManager.create``'s mappings take) raised
``AttributeError: 'str' object has no attribute 'config'`` (``list(dict)`` gives the names), and
so did any other element that is no ``OffloadManager``. Now ``GroupSpecError`` names it.
"""

from __future__ import annotations

import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.groups import GroupedLayout, GroupedManager, GroupSpec, GroupSpecError

BS = 16
NAMES = ("full", "other")  # two full-attention groups with one page each
LAYOUT = GroupedLayout(
    [GroupSpec(name=n, kind="full", block_size=BS, page_bytes=(BS * 8,)) for n in NAMES],
    hash_block_size=BS,
)


def _managers() -> list[OffloadManager]:
    config = ManagerConfig(num_cpu_blocks=4, engine="host", manage_gpu_blocks=False)
    return [OffloadManager([torch.zeros(8, BS * 8, dtype=torch.uint8)], config) for _ in range(2)]


@pytest.mark.parametrize("shape", ["dict", "strings", "nones", "one_bad"])
def test_managers_that_are_not_managers_are_a_group_spec_error(shape: str) -> None:
    managers = _managers()
    given = {
        "dict": dict(zip(NAMES, managers)),
        "strings": list(NAMES),
        "nones": [None, None],
        "one_bad": [managers[0], object()],
    }[shape]
    try:
        with pytest.raises(GroupSpecError, match="OffloadManager"):
            GroupedManager(LAYOUT, given)  # type: ignore[arg-type]
    finally:
        for mgr in managers:
            mgr.close()


def test_a_list_in_layout_order_still_builds() -> None:
    managers = _managers()
    grouped = GroupedManager(LAYOUT, managers)
    assert grouped.managers == managers
    for mgr in managers:
        mgr.close()
