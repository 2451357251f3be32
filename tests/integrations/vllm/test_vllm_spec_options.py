"""``KvmgrOffloadingSpec``'s options from ``kv_connector_extra_config``: typed errors.

Found by a new user (round 4, session 13, newuser15): ``"cpu_bytes_to_use": "32GB"`` raised a
builtin ``ValueError`` from ``int()``, and a ``kvmgr_fault_dir`` that does not exist a
``FileNotFoundError`` when vLLM asked for the manager; the docstring promises ``ConfigError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import vllm_support  # noqa: F401  (skips this module without vLLM, fails in CI)
from vllm_support import VllmRig, offload_config

from kvmgr.errors import ConfigError


def _config(**extra: Any) -> dict[str, Any]:
    return offload_config(
        "KvmgrOffloadingSpec", "kvmgr.integrations.vllm.backend", kvmgr_engine="host", **extra
    )


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"cpu_bytes_to_use": "32GB"}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": [1]}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": True}, "cpu_bytes_to_use"),
        ({"kvmgr_fault_dir": "/nonexistent/kvmgr-dir"}, "kvmgr_fault_dir"),
        ({"kvmgr_fault_dir": 3}, "kvmgr_fault_dir"),
    ],
)
def test_bad_spec_options_are_config_errors(
    tmp_path: Path, extra: dict[str, Any], match: str
) -> None:
    rig = None
    with pytest.raises(ConfigError, match=match):
        rig = VllmRig(tmp_path, _config(**extra), model_dir=tmp_path / "model")
    if rig is not None:
        rig.close()


def test_cpu_bytes_as_a_string_of_digits_is_read_as_vllm_reads_it(tmp_path: Path) -> None:
    from kvmgr.integrations.vllm import backend

    assert backend._cpu_bytes(str(1 << 20)) == 1 << 20  # vLLM's CPUOffloadingSpec: int()
    rig = VllmRig(tmp_path, _config(cpu_bytes_to_use=str(1 << 20)), model_dir=tmp_path / "model")
    rig.close()  # (built: the tier has its chunks)


def test_a_fault_dir_that_exists_is_used(tmp_path: Path) -> None:
    faults = tmp_path / "faults"
    faults.mkdir()
    rig = VllmRig(tmp_path, _config(kvmgr_fault_dir=str(faults)), model_dir=tmp_path / "model")
    try:
        assert [p.name for p in faults.iterdir() if p.name.endswith(".faults")]
    finally:
        rig.close()
