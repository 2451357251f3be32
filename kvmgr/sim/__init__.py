"""``kvmgr simulate``: replay request traces through a simulated serving loop built on kvmgr.

Offers:
    SimConfig, simulate, run_simulation   one run (loop.py)
    SimReport, render_report              its report (report.py)
    TraceRequest, TraceError, load_trace, default_trace_path   traces (trace.py)
    ReuseCeiling, reuse_ceiling           the trace's own reuse ceiling (ceiling.py)
    MODEL_PRESETS, ModelPreset            KV geometries (presets.py)

Modules: ``trace`` (Mooncake JSONL, Azure CSV), ``keys`` (chained block keys), ``ceiling``,
``gpu_cache`` (refcounted GPU prefix cache), ``pages`` (page fingerprints), ``request``,
``scheduler`` (continuous batching, admission, preemption), ``swaps`` (every manager call),
``loop`` (virtual clock, one ``manager.step()`` per step), ``report``, ``sweep``, ``cli``.
The bundled trace and its license note are in ``data/``.
"""

from __future__ import annotations

from kvmgr.sim.ceiling import ReuseCeiling, reuse_ceiling
from kvmgr.sim.loop import SimConfig, run_simulation, simulate
from kvmgr.sim.presets import MODEL_PRESETS, ModelPreset
from kvmgr.sim.report import SimReport, render_report
from kvmgr.sim.trace import TraceError, TraceRequest, default_trace_path, load_trace

__all__ = [
    "MODEL_PRESETS",
    "ModelPreset",
    "ReuseCeiling",
    "SimConfig",
    "SimReport",
    "TraceError",
    "TraceRequest",
    "default_trace_path",
    "load_trace",
    "render_report",
    "reuse_ceiling",
    "run_simulation",
    "simulate",
]
