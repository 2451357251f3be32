"""Building a ``Calibration`` from data: fits to measurements, fields, JSON (private to
``kvmgr.transfer``; ``Calibration``'s ``fit``, ``fit_duplex``, ``from_dict`` and ``from_json``
call these).

Offers:
    fit         the DMA and kernel constants from ``kvmgr bench swap`` / ``swap-kernel`` rows
    fit_duplex  the duplex bandwidths from ``kvmgr bench duplex`` rows
    from_dict   a calibration from field names to numbers
    from_json   a calibration from a JSON file, text or mapping (fields, or rows to fit)
    read_json   a JSON file, JSON text or mapping -> the mapping

Each takes the class to build (``Calibration``) rather than importing it, so ``cost_model``
imports this module and not the other way round.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kvmgr._direction import Direction
from kvmgr.errors import ConfigError

__all__ = ["fit", "fit_duplex", "from_dict", "from_json", "read_json"]

#: Field of the older, direction-blind model; ``from_dict`` maps it onto both directions.
_LEGACY_PER_DESCRIPTOR = "batch_us_per_descriptor"
#: DMA per-descriptor costs are fitted on rows with descriptors up to this size where there are
#: any: the per-descriptor term decides small descriptors; bandwidth decides large ones.
_SMALL_DESCRIPTOR_BYTES = 8192
#: the batched DMA rows of ``bench swap-kernel`` and ``bench swap`` (its old name too)
_BATCH_VARIANTS = ("batch", "batch_c", "batch_ctypes")


def from_dict(cls: Any, data: Mapping[str, Any]) -> Any:
    """``Calibration.from_dict``: a ``cls`` from field names to numbers (missing fields keep
    their defaults; the older ``batch_us_per_descriptor`` sets both directions' values).

    Raises:
        ConfigError: an unknown field, a non-numeric value or an invalid combination.
    """
    values = dict(data)
    if _LEGACY_PER_DESCRIPTOR in values:
        legacy = values.pop(_LEGACY_PER_DESCRIPTOR)
        for direction in Direction:
            values.setdefault(f"batch_{direction.value}_us_per_descriptor", legacy)
    names = sorted(f.name for f in attrs.fields(cls))
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"unknown calibration fields {unknown}; expected some of {names}")
    try:
        return cls(**{k: float(v) for k, v in values.items()})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid calibration {dict(data)}: {exc}") from exc


def from_json(cls: Any, source: str | os.PathLike[str] | Mapping[str, Any]) -> Any:
    """``Calibration.from_json``: a ``cls`` from the ``"calibration"`` fields, else a fit of the
    ``"duplex"`` or ``"copies"`` rows, else the top-level fields.

    Raises:
        ConfigError: unreadable JSON or invalid values.
    """
    data = read_json(source)
    if "calibration" in data:
        return cls.from_dict(data["calibration"])
    if "duplex" in data:  # ``kvmgr bench duplex --json``
        return cls.fit_duplex(data["duplex"])
    if "copies" in data:
        return cls.fit(data["copies"], peak_rows=data.get("peak", ()))
    return cls.from_dict(data)


def read_json(source: str | os.PathLike[str] | Mapping[str, Any]) -> Mapping[str, Any]:
    """The mapping in a JSON file, JSON text or an already parsed mapping.

    Raises:
        ConfigError: unreadable JSON, or not a JSON object.
    """
    data: Any = source
    if not isinstance(source, Mapping):
        text = str(source)
        try:
            if not text.lstrip().startswith("{"):
                with open(text, encoding="utf-8") as handle:
                    text = handle.read()
            data = json.loads(text)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"could not read a calibration from {text[:80]!r}: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a JSON object, got {type(data).__name__}")
    return data


def fit(
    cls: Any,
    rows: Sequence[Mapping[str, Any]],
    base: Any,
    peak_rows: Sequence[Mapping[str, Any]],
    interference_rows: Sequence[Mapping[str, Any]],
) -> Any:
    """``Calibration.fit`` (its docstring lists the rows).

    Kernel: least squares of launch, per-descriptor and per-direction bandwidth over the
    ``kernel`` rows. DMA: bandwidth from the ``registered`` peak rows (else ``base``'s), launch
    from ``base``; per direction, the median over the ``batch``/``batch_c`` rows (``batch_ctypes``
    in older files) of ``(us - launch - bytes / bandwidth) / descriptors``, over the rows of descriptors up to 8 KiB where
    there are any (the per-descriptor term decides small descriptors). Scattered batches hold
    thousands of descriptors, so they pin down per-descriptor costs but not launch costs.

    Raises:
        ConfigError: a row lacks a key, or the fitted values are invalid together.
    """
    values = attrs.asdict(base or cls())
    try:
        for peak in peak_rows:
            if peak.get("memory") == "registered":
                values[f"batch_{Direction(peak['direction']).value}_gbps"] = peak["gbps"]
        batch = [r for r in rows if r.get("variant") in _BATCH_VARIANTS]
        for direction in Direction:
            per_descriptor = _batch_per_descriptor(batch, direction, values)
            if per_descriptor is not None:
                values[f"batch_{direction.value}_us_per_descriptor"] = per_descriptor
        kernel = _fit_kernel([r for r in rows if r.get("variant") == "kernel"])
        _fit_slowdowns(interference_rows, values)
    except (KeyError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"calibration rows need direction, descriptors, bytes, us (interference rows: "
            f"variant, direction, slowdown_pct): {exc!r}"
        ) from exc
    if kernel is not None:
        names = ("launch_us", "us_per_descriptor", "h2d_gbps", "d2h_gbps")
        values.update({f"kernel_{k}": v for k, v in zip(names, kernel)})
    return cls.from_dict(values)


def _fit_slowdowns(rows: Sequence[Mapping[str, Any]], values: dict[str, Any]) -> None:
    """The compute slowdowns of the interference rows into ``values``: the kernel's per
    direction, the mean of the ``batch`` rows' (``slowdown_pct`` / 100, floored at 0).

    Raises:
        KeyError, ValueError, TypeError: a row lacks a key or holds a bad value.
    """
    batch_slowdowns = []
    for row in rows:
        slowdown = max(float(row["slowdown_pct"]) / 100.0, 0.0)
        if row["variant"] == "kernel":
            values[f"kernel_{Direction(row['direction']).value}_slowdown"] = slowdown
        elif row["variant"] == "batch":
            batch_slowdowns.append(slowdown)
    if batch_slowdowns:
        values["batch_slowdown"] = statistics.fmean(batch_slowdowns)


def fit_duplex(cls: Any, rows: Sequence[Mapping[str, Any]], base: Any) -> Any:
    """``Calibration.fit_duplex``: the duplex bandwidths, medians of the bench rows."""
    values = attrs.asdict(base or cls())
    try:
        fields = {
            "duplex_kernel_gbps": ("kernel+kernel",),
            "duplex_limit_gbps": ("limit",),
            "duplex_mixed_gbps": ("kernel+contiguous", "contiguous+kernel"),
        }
        for field, variants in fields.items():
            measured = [float(r["gbps"]) for r in rows if r.get("variant") in variants]
            if measured:
                values[field] = statistics.median(measured)
    except (KeyError, ValueError, TypeError) as exc:
        raise ConfigError(f"duplex rows need variant and gbps: {exc!r}") from exc
    return cls.from_dict(values)


def _batch_per_descriptor(
    rows: Sequence[Mapping[str, Any]], direction: Direction, values: Mapping[str, float]
) -> float | None:
    gbps, launch = values[f"batch_{direction.value}_gbps"], values["batch_launch_us"]
    rows = [r for r in rows if Direction(r["direction"]) is direction and r["descriptors"] > 0]
    small = [r for r in rows if r["bytes"] <= _SMALL_DESCRIPTOR_BYTES * r["descriptors"]]
    costs = [
        (float(r["us"]) - launch - float(r["bytes"]) / (1e3 * gbps)) / float(r["descriptors"])
        for r in small or rows
    ]
    return max(statistics.median(costs), 0.0) if costs else None


def _fit_kernel(rows: Sequence[Mapping[str, Any]]) -> tuple[float, ...] | None:
    # us = launch + per_descriptor * n + a * bytes_h2d + b * bytes_d2h; GB/s = 1e-3 / a.
    is_h2d = np.array([Direction(r["direction"]) is Direction.H2D for r in rows], dtype=bool)
    n, num_bytes, us = (
        np.array([r[k] for r in rows], dtype=np.float64) for k in ("descriptors", "bytes", "us")
    )
    columns = [np.ones_like(n), n, np.where(is_h2d, num_bytes, 0), np.where(is_h2d, 0, num_bytes)]
    design = np.stack(columns, axis=1) if len(rows) else np.zeros((0, 4))
    if len(rows) < 4 or np.linalg.matrix_rank(design) < 4:
        return None
    launch, per_descriptor, a, b = np.linalg.lstsq(design, us, rcond=None)[0]
    if a <= 0 or b <= 0:
        return None
    return max(launch, 0.0), max(per_descriptor, 0.0), 1e-3 / a, 1e-3 / b
