"""``kvmgr bench swap --variants``: the column names and the deprecated ``batch_ctypes`` alias."""

from __future__ import annotations

import argparse

import pytest

from kvmgr.bench import swap
from kvmgr.bench.common import DEPRECATED_VARIANTS, default_variants, select_variants


def test_the_batched_c_call_is_named_batch_c() -> None:
    assert list(default_variants()) == ["loop", "batch_c", "batch_lists"]
    assert DEPRECATED_VARIANTS == {"batch_ctypes": "batch_c"}


def test_the_old_name_selects_batch_c_and_warns() -> None:
    variants = default_variants()
    with pytest.warns(FutureWarning, match="'batch_ctypes' is now named 'batch_c'"):
        chosen = select_variants(variants, ["batch_ctypes", "loop"])
    assert list(chosen) == ["loop", "batch_c"]  # the columns' order, not the flag's
    assert chosen["batch_c"] is variants["batch_c"]


def test_current_names_select_without_a_warning(recwarn: pytest.WarningsRecorder) -> None:
    variants = default_variants()
    assert list(select_variants(variants, ["batch_lists", "batch_c"])) == ["batch_c", "batch_lists"]
    assert select_variants(variants, None) is variants
    assert list(select_variants(variants, ["kernel"])) == []  # not a column here: left out
    assert not recwarn.list


def test_the_cli_flag_takes_both_names() -> None:
    parser = argparse.ArgumentParser()
    swap.add_arguments(parser)
    args = parser.parse_args(["--variants", "batch_ctypes", "kernel"])
    assert args.variants == ["batch_ctypes", "kernel"]
    with pytest.warns(FutureWarning):
        assert list(select_variants(default_variants(), args.variants)) == ["batch_c"]
