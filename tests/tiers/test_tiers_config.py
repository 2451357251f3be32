"""The tier constructors' bad input raises ``ConfigError`` (issue 20: they raised attrs'
``ValueError``/``TypeError``, Python's ``TypeError`` or urllib's ``ValueError``), before anything
is opened."""

from __future__ import annotations

import math

import pytest

from kvmgr.errors import ConfigError
from kvmgr.tiers import DiskTier, SharedTier, TierNamespace

GOOD_NS = {"model": "m", "page_bytes": (64,), "dtype_names": ("uint8",), "block_size": 16}


@pytest.mark.parametrize(
    "bad",
    [
        {"block_size": 0},
        {"block_size": 2.5},
        {"block_size": True},
        {"tenant_salt": "t42"},
        {"tenant_salt": None},
        {"key_prefix": "kv:"},
        {"page_bytes": 64},
        {"page_bytes": (64.0,)},
        {"dtype_names": "uint8"},
        {"model": ""},
        {"model": None},
    ],
)
def test_namespace_bad_fields_raise_config_error(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as info:
        TierNamespace(**{**GOOD_NS, **bad})  # type: ignore[arg-type]
    assert "t42" not in str(info.value)  # a salt is never echoed


@pytest.mark.parametrize(
    "bad",
    [
        {"slot_bytes": None},
        {"slot_bytes": 0},
        {"num_slots": 2.5},
        {"num_slots": True},
        {"num_files": "2"},
        {"io_threads": 0},
        {"deadline_s": math.inf},
        {"deadline_s": 0},
        {"deadline_s": None},
    ],
)
def test_disk_tier_bad_arguments_raise_config_error(tmp_path, bad: dict[str, object]) -> None:
    args: dict[str, object] = {"slot_bytes": 4096, "num_slots": 4, **bad}
    with pytest.raises(ConfigError):
        DiskTier(tmp_path / "tier.bin", **args)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())  # nothing was created


def test_disk_tier_bad_path_raises_config_error() -> None:
    with pytest.raises(ConfigError):
        DiskTier(None, slot_bytes=4096, num_slots=4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:99999",
        "redis://127.0.0.1:0",
        "redis://127.0.0.1:http",
        "redis://127.0.0.1:1/db",
        "redis://h1:1,h2:2/0",
        "redis+cluster://h1:1/3",
        "unix://relative.sock",
        None,
    ],
)
def test_shared_tier_bad_urls_raise_config_error(url: object) -> None:
    with pytest.raises(ConfigError):
        SharedTier(url, single_tenant=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        {"deadline_s": 0},
        {"deadline_s": math.nan},
        {"hint_deadline_s": -1},
        {"max_connections": 0},
        {"max_connections": 1.5},
        {"trip_after_timeouts": 0},
        {"ttl_s": 0},
    ],
)
def test_shared_tier_bad_limits_raise_config_error(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        SharedTier("redis://127.0.0.1:6379/0", single_tenant=True, **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        {"reconnect_backoff_s": 2, "max_backoff_s": 1},
        {"reconnect_backoff_s": 0.5, "max_backoff_s": 0},
        {"max_backoff_s": 0.1},  # below the default first period (0.25 s)
        {"max_backoff_s": -1},
        {"max_backoff_s": math.inf},
    ],
)
def test_shared_tier_inconsistent_backoff_raises_config_error(bad: dict[str, object]) -> None:
    """The breaker's cap below its first period was accepted, the first period winning
    silently (leftovers14): now a ``ConfigError`` before the tier is built."""
    with pytest.raises(ConfigError, match="max_backoff_s"):
        SharedTier("redis://127.0.0.1:6379/0", single_tenant=True, **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "cap_s"),
    [
        ({}, 5.0),
        ({"reconnect_backoff_s": 30.0}, 30.0),  # no cap given: the first period is the cap
        ({"reconnect_backoff_s": 1.0, "max_backoff_s": 1.0}, 1.0),
        ({"reconnect_backoff_s": 0.0, "max_backoff_s": 0.0}, 0.0),
    ],
)
def test_shared_tier_consistent_backoff_is_accepted(
    options: dict[str, float], cap_s: float
) -> None:
    tier = SharedTier("redis://127.0.0.1:6379/0", single_tenant=True, **options)  # type: ignore[arg-type]
    assert tier._calls._make_breaker()._max_s == cap_s  # the breaker a server gets
