"""Comma-separated counts of the benchmarks (``--ranks``, ``--tokens``, ``--mla-tokens``) are
checked when parsed: a bad value is a one-line usage error (exit 2), not a ``ValueError``
traceback from inside the run (``kvmgr bench ranks --ranks x`` crashed; ``--ranks 0`` said
"--heads 8 must split evenly").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvmgr import cli
from kvmgr.bench._options import int_list


@pytest.mark.parametrize(
    "argv",
    [
        ["ranks", "--ranks", "x"],
        ["ranks", "--ranks", "0"],
        ["ranks", "--ranks", "1,-2"],
        ["launch-host", "--tokens", "x"],
        ["launch-host", "--tokens", ""],
        ["mla-insert", "--tokens", "1,,x"],
        ["peer-mla", "--mla-tokens", "0"],
        ["peer", "--mla-tokens", "1.5"],
    ],
)
def test_bad_counts_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[1]}: expected comma-separated ints >= 1" in err, err
    assert "Traceback" not in err


def test_int_list_parses_counts() -> None:
    assert int_list("1,64, 512,") == [1, 64, 512]
    for bad in ("", "a", "1,0", "2.5", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            int_list(bad)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["policy", "--block-size", "0"], "expected an int >= 1"),
        (["dsv4", "--repeats", "0"], "expected an int >= 1"),
        (["tiers", "--rounds", "0"], "expected an int >= 1"),
        (["host", "--rounds", "-1"], "expected an int >= 1"),
        (["swap", "--repeats", "x"], "expected an int >= 1"),
        (["pin", "--gib", "nan"], "expected a finite number > 0"),
        (["pin", "--gib", "inf"], "expected a finite number > 0"),
    ],
)
def test_bad_counts_and_sizes_are_usage_errors(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Session 14 (newuser16): ``bench policy --block-size 0``, ``bench pin --gib nan``,
    ``bench dsv4 --repeats 0`` and ``bench tiers --rounds 0`` crashed with a traceback (or
    inside fio) instead of a usage error."""
    code = None
    try:
        code = cli.main(["bench", *argv])
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[1]}: {expected}" in err, err
    assert "Traceback" not in err


def test_tiers_disk_dir_must_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing"
    assert cli.main(["bench", "tiers", "--sections", "disk", "--disk-dir", str(missing)]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert not missing.exists()
