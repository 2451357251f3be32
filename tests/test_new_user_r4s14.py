"""Round 4, session 14 (helper newuser16): a new user's bad flags and tier races."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager, cli
from kvmgr.errors import ConfigError
from kvmgr.sim import cli as sim_cli
from kvmgr.sim.config import SimConfig
from kvmgr.tiers import PutResult, TierStatistics


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the simulation starts (the flags must be refused first)."""

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("the run started before the arguments were checked")

    monkeypatch.setattr(sim_cli, "load_trace", refuse)
    monkeypatch.setattr(sim_cli, "simulate", refuse)
    monkeypatch.setattr(sim_cli, "run_sweep", refuse)


# --time-scale inf hung (every arrival at inf: the loop never reached one); --step-ms inf
# reported "virtual time inf s; TTFT nan" with exit 0; --max-memory-gib inf was a traceback
# (OverflowError from int()), nan "cannot convert float NaN to integer"; --sweep-policies ','
# ran no run and drew an empty plot.
_BAD_FLAGS = [
    (["--time-scale", "inf"], "time_scale: expected a finite number > 0"),
    (["--step-ms", "inf"], "step_ms"),
    (["--max-memory-gib", "inf"], "--max-memory-gib: expected a finite number >= 0"),
    (["--max-memory-gib", "nan"], "--max-memory-gib: expected a finite number >= 0"),
    (["--max-memory-gib", "-1"], "--max-memory-gib: expected a finite number >= 0"),
    (["--sweep", "1M", "--sweep-policies", ","], "--sweep-policies: expected one policy"),
]


@pytest.mark.parametrize(("extra", "message"), _BAD_FLAGS)
def test_non_finite_and_empty_flags_are_one_line_and_exit_2(
    extra: list[str], message: str, no_run: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["simulate", "--quiet", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvmgr simulate: error:") and message in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("field", ["time_scale", "step_ms"])
def test_sim_config_refuses_infinite_times(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        SimConfig(**{field: float("inf")})


def test_finite_extremes_still_run(tmp_path: Path) -> None:
    """Infinite throughput and bandwidth are meaningful (free compute, free loads): they run."""
    argv = ["simulate", "--quiet", "--limit", "3", "--tokens-per-s", "inf", "--h2d-gbps", "inf"]
    assert cli.main([*argv, "--json", str(tmp_path / "r.json")]) == 0


# ---------------------------------------------------------------- the event stream at close


class _HeldTier:
    """A lower tier whose writes wait until the test lets them go (a frozen server)."""

    name = "held"
    single_tenant = True

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def put_many(self, keys, blobs):  # type: ignore[no-untyped-def]
        await self.release.wait()
        n = len(keys)
        return PutResult(np.ones(n, dtype=bool), n, 0, 0.0)

    async def get_many(self, keys):  # type: ignore[no-untyped-def]
        return [None] * len(keys)

    async def contains_many(self, keys):  # type: ignore[no-untyped-def]
        return np.zeros(len(keys), dtype=bool)

    async def delete_many(self, keys):  # type: ignore[no-untyped-def]
        return 0

    async def aclose(self) -> None:
        self.release.set()

    def statistics(self) -> TierStatistics:
        return TierStatistics(name="held")


@pytest.mark.asyncio
async def test_a_write_through_that_ends_after_close_records_no_event() -> None:
    """``cleared`` is the stream's last event: a lower-tier write still running when ``aclose``
    gave up waiting (a frozen server) appended ``stored`` (tier ``held``) after it, so a router
    draining ``take_events()`` indexed blocks of an instance that had closed."""
    tier = _HeldTier()
    gpu = [torch.randn(8, 4, 16)]
    config = ManagerConfig(num_cpu_blocks=8, tier_write_through=True)
    mgr = OffloadManager(gpu, config, tiers=[tier])
    ids = mgr.allocate("a", 2)
    stored = mgr.swap_out(ids, [b"k0" * 8, b"k1" * 8])
    await mgr.step()
    await stored
    await mgr.aclose(timeout_s=0.01)  # the write-through is still held
    events = mgr.take_events()
    assert events[-1].kind == "cleared"
    tier.release.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert mgr.take_events() == []  # nothing after the close's cleared
