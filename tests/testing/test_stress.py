"""The randomized stress (``kvmgr.testing.stress``), short: several seeds, every operation.

The long runs (10^6 operations) are ``python -m kvmgr.testing.stress``; see BENCHMARKS.md.
These check that a short run drives every operation, compares pages and finds nothing, and
that the stress itself can fail: a manager that serves wrong bytes is caught.
"""

from __future__ import annotations

import asyncio

import pytest

from kvmgr.testing.stress import WEIGHTS, StressFailure, main, run_stress


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_short_stress_finds_nothing_and_drives_every_operation(seed: int) -> None:
    report = asyncio.run(run_stress(3_000, seed=seed, episode_ops=1_000))
    assert report.ops == 3_000 and report.episodes == 3
    assert report.steps > 100 and report.page_checks > 1_000
    for name in WEIGHTS:
        assert report.counts[f"op.{name}"] > 0, name
    for outcome in ("store.ok", "load.ok", "preempt.ok", "resume.ok", "store.TransferError"):
        assert report.counts.get(outcome, 0) > 0, outcome
    assert not any(k.startswith("untyped") for k in report.counts)


def test_the_stress_catches_a_manager_that_serves_wrong_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bookkeeper that flips one byte of the fifth landed store's CPU block: caught."""
    from kvmgr.scheduler import bookkeeping
    from kvmgr.worker import TransferWorker

    complete = bookkeeping.Bookkeeper.complete
    init = TransferWorker.__init__
    workers: list[TransferWorker] = []  # the scheduler holds no tensors: the worker's CPU tier
    landed = [0]

    def recording(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        workers.append(self)

    def corrupting(self, lane, gpu_ids, cpu_ids, ok):  # type: ignore[no-untyped-def]
        result = complete(self, lane, gpu_ids, cpu_ids, ok)
        if ok and lane.keys:
            landed[0] += 1
            if landed[0] == 5:
                workers[-1].cpu_pool.tensors[0][int(cpu_ids[0])] ^= 0x5A
        return result

    monkeypatch.setattr(TransferWorker, "__init__", recording)
    monkeypatch.setattr(bookkeeping.Bookkeeper, "complete", corrupting)
    with pytest.raises(StressFailure, match="wrong bytes"):
        asyncio.run(run_stress(3_000, seed=0, episode_ops=1_000))


def test_the_command_line_prints_a_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["--ops", "400", "--episode-ops", "200"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ops"] == 400 and report["episodes"] == 2 and report["seeds"] == [0]
