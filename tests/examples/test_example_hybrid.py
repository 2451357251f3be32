"""The hybrid example (examples/engine/hybrid.py): a sliding-window + full-attention decoder
restored through GroupedManager decodes bit for bit as the run that never left the GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from examples.engine.hybrid import HybridConfig, HybridModel, offload_and_continue


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.asyncio
@pytest.mark.parametrize(("window", "length"), [(24, 75), (9, 40), (8, 33), (17, 64), (200, 57)])
async def test_restored_run_decodes_bit_for_bit_from_the_window_only(
    window: int, length: int
) -> None:
    config = dataclasses.replace(HybridConfig(), window=window)
    model = HybridModel(config, seed=window)
    run = await offload_and_continue(model, prompt(length, length), 6)
    assert run.plan.num_tokens == (length - 1) // 8 * 8 > 0
    n = run.plan.num_tokens
    # the sliding-window group loaded only the blocks of the last W - 1 tokens (the GPU never
    # held the others after the restore: a read of one raises LookupError in forward_chunk)
    assert run.plan.blocks[1] == range(max(0, n - window + 1) // 8, n // 8)
    assert all(torch.equal(a, b) for a, b in zip(run.baseline, run.restored, strict=True))
    if window < n:
        assert run.plan.num_bytes < run.all_full_bytes


@pytest.mark.asyncio
@pytest.mark.parametrize("group", ["swa", "full"])
async def test_a_missing_block_changes_the_logits(group: str) -> None:
    # negative controls: the comparison must catch a wrong block in either group
    model = HybridModel(HybridConfig(), seed=3)

    def poison(caches: dict[str, list[torch.Tensor]], tables: dict[str, list[int | None]]) -> None:
        first = next(b for b in tables[group] if b is not None)
        for t in caches[group]:
            t[first] = torch.randn(t[first].shape, generator=torch.Generator().manual_seed(9))

    run = await offload_and_continue(model, prompt(75, 75), 3, after_load=poison)
    assert not torch.equal(run.baseline[0], run.restored[0])
