"""ManagerConfig: defaults, validation with readable errors, frozen instances, from_dict, evolve."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

from kvmgr import ConfigError, ManagerConfig
from kvmgr.config import BACKPRESSURE_MODES, FLUSH_MODES
from kvmgr.policy import POLICIES
from kvmgr.transfer import ENGINES


def test_defaults() -> None:
    cfg = ManagerConfig(num_cpu_blocks=16)
    assert (cfg.policy, cfg.engine, cfg.flush, cfg.backpressure) == ("lru", "auto", "step", "fail")
    assert (cfg.manage_gpu_blocks, cfg.merge, cfg.allow_pageable) == (True, True, False)
    assert cfg.max_descriptors is None and cfg.store_wait_s == 1.0
    # core v2 (issue 11): store admission, the KV event stream, policy options
    assert (cfg.store_threshold, cfg.max_events, dict(cfg.policy_options)) == (1, 4096, {})


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("engine", ENGINES)
def test_every_registered_name_is_accepted(policy: str, engine: str) -> None:
    cfg = ManagerConfig(num_cpu_blocks=3, policy=policy, engine=engine)
    assert (cfg.policy, cfg.engine) == (policy, engine)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_cpu_blocks": 0}, "num_cpu_blocks"),
        ({"num_cpu_blocks": -3}, "num_cpu_blocks"),
        ({"num_cpu_blocks": 2.0}, "num_cpu_blocks"),
        ({"num_cpu_blocks": "8"}, "num_cpu_blocks"),
        # issue 11 section 5: a ConfigError naming the value, not torch's TypeError later
        ({"num_cpu_blocks": 10**21}, "num_cpu_blocks"),
        ({"num_cpu_blocks": 4, "store_threshold": 0}, "store_threshold"),
        ({"num_cpu_blocks": 4, "store_threshold": True}, "store_threshold"),
        ({"num_cpu_blocks": 4, "max_events": -1}, "max_events"),
        ({"num_cpu_blocks": 4, "max_events": 1.5}, "max_events"),
        ({"num_cpu_blocks": 4, "max_events": 2**70}, "max_events"),  # was OverflowError later
        ({"num_cpu_blocks": True}, "num_cpu_blocks"),
        ({"num_cpu_blocks": 4, "max_descriptors": 0}, "max_descriptors"),
        ({"num_cpu_blocks": 4, "flush": "never"}, "flush"),
        ({"num_cpu_blocks": 4, "backpressure": "block"}, "backpressure"),
        ({"num_cpu_blocks": 4, "store_wait_s": -0.5}, "store_wait_s"),
        ({"num_cpu_blocks": 4, "store_wait_s": "1"}, "store_wait_s"),
    ],
)
def test_invalid_values_raise_config_error_naming_the_field(
    kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        ManagerConfig(**kwargs)


@pytest.mark.parametrize("field", ["manage_gpu_blocks", "merge", "allow_pageable"])
def test_flags_must_be_bools(field: str) -> None:
    with pytest.raises((ConfigError, TypeError)):
        ManagerConfig(num_cpu_blocks=4, **{field: 1})


def test_policy_options_must_be_a_mapping() -> None:
    # attrs' instance_of raises TypeError here, as for the flags above
    with pytest.raises((ConfigError, TypeError)):
        ManagerConfig(num_cpu_blocks=4, policy_options=[("clock", None)])  # type: ignore[arg-type]


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        ManagerConfig(num_cpu_blocks=4, policy="lfu")
    message = str(info.value)
    assert "'lfu'" in message
    assert all(name in message for name in POLICIES)


def test_unknown_engine_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        ManagerConfig(num_cpu_blocks=4, engine="dma")
    assert all(name in str(info.value) for name in ENGINES)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"policy": ["lru"]}, id="policy-list"),
        pytest.param({"engine": ["host"]}, id="engine-list"),
        pytest.param({"store_wait_s": math.nan}, id="wait-nan"),
        pytest.param({"store_wait_s": True}, id="wait-bool"),
    ],
)
def test_more_invalid_values_raise_config_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        ManagerConfig(num_cpu_blocks=4, **kwargs)


def test_config_is_frozen_and_evolve_revalidates() -> None:
    cfg = ManagerConfig(num_cpu_blocks=4)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.num_cpu_blocks = 8  # type: ignore[misc]
    bigger = attrs.evolve(cfg, num_cpu_blocks=8, policy="arc")
    assert (bigger.num_cpu_blocks, bigger.policy, cfg.num_cpu_blocks) == (8, "arc", 4)
    with pytest.raises(ConfigError):
        attrs.evolve(cfg, num_cpu_blocks=0)
    with pytest.raises(ConfigError):
        attrs.evolve(cfg, flush="sometimes")


def test_configs_compare_by_value() -> None:
    assert ManagerConfig(num_cpu_blocks=4, policy="arc") == ManagerConfig(
        num_cpu_blocks=4, policy="arc"
    )
    assert ManagerConfig(num_cpu_blocks=4) != ManagerConfig(num_cpu_blocks=5)


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        ManagerConfig(4)  # type: ignore[misc]


def test_from_dict_round_trip() -> None:
    cfg = ManagerConfig(
        num_cpu_blocks=32,
        policy="arc",
        flush="tick",
        backpressure="wait",
        store_wait_s=0.25,
        store_threshold=2,
        max_events=0,
    )
    assert ManagerConfig.from_dict(attrs.asdict(cfg)) == cfg
    assert ManagerConfig.from_dict({"num_cpu_blocks": 2}) == ManagerConfig(num_cpu_blocks=2)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"num_cpu_blocks": 4, "cpu_blocks": 4}, "cpu_blocks"),  # unknown key, named
        ({"num_cpu_blocks": 4, "policy": "mru"}, "mru"),  # invalid value
        ({}, "num_cpu_blocks"),  # required key missing: a ConfigError, not a TypeError
    ],
)
def test_from_dict_rejects_bad_input(data: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ManagerConfig.from_dict(data)


def test_mode_tuples_are_what_the_docs_list() -> None:
    assert FLUSH_MODES == ("step", "tick")
    assert BACKPRESSURE_MODES == ("fail", "wait")
    assert set(ENGINES) == {"auto", "host", "cuda", "kernel"}
