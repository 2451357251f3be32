"""Bad arguments of the event publisher and format: a typed ``ConfigError`` at construction.

Round 4, session 13 (newuser14): ``ZmqEventPublisher(topic=b"kv")`` raised ``AttributeError``
and ``data_parallel_rank="1"`` a ``TypeError``; ``event_format="x"``, ``VllmEventFormat(media=
{"cpu": "CPU"})`` and ``VllmEventFormat(kv_cache_spec_kind=3)`` were accepted, and then every
batch failed on the publisher's thread (logged, never published: a router heard nothing) or
was published with a field vLLM's decoder refuses.
"""

from __future__ import annotations

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kvmgr.errors import ConfigError
from kvmgr.events import TierMedium, VllmEventFormat, ZmqEventPublisher


@pytest.mark.parametrize(
    "kwargs",
    [
        {"topic": b"kv"},
        {"topic": None},
        {"data_parallel_rank": "1"},
        {"data_parallel_rank": True},
        {"data_parallel_rank": 1.0},
        {"event_format": "x"},
        {"event_format": {"hash_format": "int"}},
    ],
    ids=repr,
)
def test_publisher_refuses_bad_arguments_with_config_error(tmp_path, kwargs) -> None:
    with pytest.raises(ConfigError):
        ZmqEventPublisher(f"ipc://{tmp_path}/events", **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"media": {"cpu": "CPU"}},
        {"media": {"cpu": None}},
        {"media": [("cpu", TierMedium(medium="CPU"))]},
        {"media": {1: TierMedium(medium="CPU")}},
        {"kv_cache_spec_kind": 3},
        {"hash_format": ["int"]},
    ],
    ids=repr,
)
def test_format_refuses_bad_arguments_with_config_error(kwargs) -> None:
    with pytest.raises(ConfigError):
        VllmEventFormat(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"medium": 1}, {"medium": "CPU", "locality": 2}, {"medium": "CPU", "ownership": b"x"}],
    ids=repr,
)
def test_tier_medium_refuses_non_strings(kwargs) -> None:
    with pytest.raises(ConfigError):
        TierMedium(**kwargs)


def test_good_arguments_still_build(tmp_path) -> None:
    fmt = VllmEventFormat(
        media={
            "cpu": TierMedium(medium="CPU"),
            "disk": TierMedium(medium="STORAGE", ownership="d"),
        },
        kv_cache_spec_kind="full_attention",
    )
    with ZmqEventPublisher(
        f"ipc://{tmp_path}/events", topic="kv", data_parallel_rank=1, event_format=fmt
    ) as publisher:
        assert publisher.endpoint.endswith("_dp1")
