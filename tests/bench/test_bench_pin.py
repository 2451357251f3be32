"""``kvmgr bench pin`` runs its CPU phases anywhere (allocation, first touch) and checks input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvmgr import cli


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the bench registers too")
def test_the_cpu_phases_are_measured_without_a_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pin.json"
    argv = ["bench", "pin", "--gib", "0.02", "--threads", "2", "--json", str(out),
            "--variants", "torch+touch1,mmap+touchN,pieces"]  # fmt: skip
    assert cli.main(argv) == 0
    assert "registration not measured" in capsys.readouterr().out
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["torch+touch1"]["touch_s"] > 0 and rows["mmap+touchN"]["touch_s"] > 0
    assert rows["mmap+touchN"]["register_s"] is None and rows["pieces"]["register_s"] is None


@pytest.mark.parametrize(
    "argv", [["--gib", "0"], ["--threads", "0"], ["--variants", "round3,nope"]]
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = cli.main(["bench", "pin", *argv])
    except SystemExit as exit_info:  # a usage error from argparse (``--gib``'s type)
        code = exit_info.code
    assert code == 2
    assert "kvmgr bench pin: error" in capsys.readouterr().err
