"""Comma-separated counts of the benchmarks (``--ranks``, ``--tokens``, ``--mla-tokens``) are
checked when parsed: a bad value is a one-line usage error (exit 2), not a ``ValueError``
traceback from inside the run (``kvmgr bench ranks --ranks x`` crashed; ``--ranks 0`` said
"--heads 8 must split evenly").
"""

from __future__ import annotations

import argparse

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
