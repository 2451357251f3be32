"""vLLM's own KV event classes for the wire-compatibility tests.

``vllm_kv_events()`` imports ``vllm.distributed.kv_events`` (vLLM installed with ``--no-deps``
imports its scheduler side on a CPU machine). Without vLLM the tests skip; with
``KVMGR_REQUIRE_VLLM=1`` (set by CI, which installs vLLM) a missing vLLM fails them instead.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

import pytest

__all__ = ["vllm_kv_events"]

_HINT = "needs vLLM's scheduler side: pip install --no-deps vllm (plus msgspec and pyzmq)"


def vllm_kv_events() -> ModuleType:
    """``vllm.distributed.kv_events``; skips, or fails under ``KVMGR_REQUIRE_VLLM=1``."""
    try:
        with warnings.catch_warnings():  # vLLM's import chain warns (torch.jit deprecations)
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            from vllm.distributed import kv_events
    except Exception as exc:  # ImportError, or a missing dependency of vLLM's import chain
        if os.environ.get("KVMGR_REQUIRE_VLLM") == "1":
            pytest.fail(f"KVMGR_REQUIRE_VLLM=1 but vLLM does not import ({exc!r}): {_HINT}")
        pytest.skip(f"{_HINT} ({exc!r})")
    return kv_events
