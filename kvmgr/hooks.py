"""Per-step hooks: what runs on the compute stream once per scheduler step.

Offers:
    StepContext   what the scheduler knows about the step (host arrays, device tensors, stream)
    StepHook      the protocol a hook implements
    HookReport    what a hook reports back (launches, skips, free-form counters)

``OffloadManager.step(ctx)`` runs the registered hooks in order, then flushes the queued
transfers, so a store issued in the same step sees what the hooks wrote. Built-in hooks wrapping
kernels live next to their kernels (``kvmgr.kernels``) and are re-exported by ``kvmgr``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np

from kvmgr.errors import InvalidArgumentError

__all__ = ["HookReport", "StepContext", "StepHook"]


def _step_number(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0
    ):
        raise InvalidArgumentError(f"StepContext.step: expected an int >= 0 or None, got {value!r}")


def _flag(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"StepContext.{attribute.name}: expected a bool, got {value!r}")


def _tensors(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"StepContext.tensors: expected a mapping, got {value!r}")


def _stream(instance: Any, attribute: Any, value: Any) -> None:
    # the rule of ``OffloadManager.stream_wait_loads``: a stream has ``wait_event``
    if value is not None and not callable(getattr(value, "wait_event", None)):
        raise InvalidArgumentError(
            "StepContext.stream: expected None or a CUDA stream (torch.cuda.Stream), "
            f"got {value!r:.60}"
        )


@attrs.frozen(kw_only=True)
class StepContext:
    """What one scheduler step knows, passed to every hook.

    Attributes:
        step: step number, counted by the caller (the manager fills in its own if ``None``).
        num_computed_tokens: host int array ``[num_reqs]``: tokens of each request already in
            the KV cache before this step, or ``None`` when unknown.
        query_start_loc: host int array ``[num_reqs + 1]``: cumulative new-token offsets of the
            step (request ``r`` computes tokens ``query_start_loc[r]:query_start_loc[r+1]``), or
            ``None`` when unknown.
        tensors: device tensors by name (``"slot_mapping"``, ``"kv_c"``, ...), as the hooks
            that use them document.
        stream: the compute stream (a ``torch.cuda.Stream``), or ``None`` for the current one.
        is_capturing: True while the step is being captured into a CUDA graph: hooks must not
            read device data on the host nor skip launches based on host state that changes
            between replays.

    Raises:
        InvalidArgumentError: ``step`` is not an int >= 0 or ``None``, ``tensors`` is not a
            mapping, ``stream`` is neither ``None`` nor a stream (an object with
            ``wait_event``), or ``is_capturing`` is not a bool.
    """

    step: int | None = attrs.field(default=None, validator=_step_number)
    num_computed_tokens: np.ndarray | None = None
    query_start_loc: np.ndarray | None = None
    tensors: Mapping[str, Any] = attrs.field(factory=dict, validator=_tensors)
    stream: Any = attrs.field(default=None, validator=_stream)
    is_capturing: bool = attrs.field(default=False, validator=_flag)


@attrs.frozen(kw_only=True)
class HookReport:
    """What one hook did in one step.

    Attributes:
        name: the hook's name.
        launches: kernel launches issued.
        skips: launches skipped by a host-side gate.
        host_s: host seconds spent in the hook (wall clock, not device time).
        extra: hook-specific counters.
    """

    name: str
    launches: int = 0
    skips: int = 0
    host_s: float = 0.0
    extra: Mapping[str, Any] = attrs.field(factory=dict)

    @classmethod
    def of(cls, name: str, launches: int, skips: int, host_s: float, extra: Mapping[str, Any]) -> HookReport:  # fmt: skip
        """The same report, every field given positionally: for hooks on the per-step hot path
        (about half the host time of the keyword constructor's ~1 us on a 2-core CPU host)."""
        report = _new(cls)
        _set_name(report, name)
        _set_launches(report, launches)
        _set_skips(report, skips)
        _set_host_s(report, host_s)
        _set_extra(report, extra)
        return report


# HookReport.of writes the slots directly (the frozen class's own __init__ does the same through
# object.__setattr__), bound once here
_new = object.__new__
_set_name, _set_launches, _set_skips, _set_host_s, _set_extra = (
    HookReport.__dict__[field.name].__set__ for field in attrs.fields(HookReport)
)


@runtime_checkable
class StepHook(Protocol):
    """A kernel (or any work) that runs once per scheduler step on the compute stream.

    ``__call__`` must only enqueue work (no host synchronisation), return how many launches it
    issued and skipped, and be safe under CUDA-graph capture when ``ctx.is_capturing``.
    """

    name: str

    def __call__(self, ctx: StepContext) -> HookReport: ...
