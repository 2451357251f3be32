"""Metrics of an ``OffloadManager``: a plain snapshot, and Prometheus export when available.

Offers:
    Sample              one metric value: name, kind (counter or gauge), labels, help text
    MetricsSnapshot     every sample of one ``statistics()`` reading; ``value()``, ``as_dict()``
    metrics_snapshot    manager (or ``ManagerStatistics``) -> ``MetricsSnapshot``
    PrometheusExporter  a Prometheus collector reading a fresh snapshot at every scrape

The series (prefix ``kvmgr`` by default; counters are totals since the manager was created):

=================================  =======  =============  =====================================
name                               kind     labels         meaning
=================================  =======  =============  =====================================
lookups_total                      counter                 ``lookup`` calls
lookup_keys_total                  counter                 keys asked
lookup_hits_total                  counter                 keys found READY (prefix hits)
lookup_misses_total                counter                 keys asked and not hit
evictions_total                    counter  policy         CPU blocks evicted
stores_rejected_total              counter  reason         stores refused (``cpu_full``, ...)
await_timeouts_total               counter                 ``wait`` deadlines passed
blocks_stored_total                counter  outcome        queued / completed / failed / skipped
                                                           / not_admitted
blocks_loaded_total                counter  outcome        queued / completed / failed
transfer_bytes_total               counter  direction      bytes of completed batches
transfer_device_seconds_total      counter  direction      their device (or copy-thread) seconds
steps_total                        counter                 ``step()`` calls
copies_in_flight                   gauge                   batches submitted, not completed
queued_swaps                       gauge                   swaps waiting for the next flush
stores_waiting                     gauge                   stores waiting for room (backpressure)
cpu_blocks                         gauge    state          CPU tier blocks ``used`` / ``free`` /
                                                           ``unpinned`` (not page-locked yet)
cpu_pin_seconds                    gauge                   seconds page-locking the CPU tier took
cpu_keys                           gauge    state          keyed CPU blocks ``pending`` / ``ready``
                                                           / ``loading`` (READY with loads)
gpu_blocks_free                    gauge                   free owned GPU blocks (if owned)
peeks_total                        counter                 ``peek`` calls
invalidated_total                  counter                 keys dropped by invalidate / clear
events_dropped_total               counter                 KV events dropped undrained
batch_blocks                       histo.   le             blocks per submitted batch
completion_seconds                 histo.   le             submission -> completion per batch
=================================  =======  =============  =====================================

``prometheus_client`` is optional (``pip install kvmgr[metrics]``); this module imports without it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from kvmgr.reports import ManagerStatistics

if TYPE_CHECKING:
    from kvmgr.manager import OffloadManager

__all__ = ["MetricsSnapshot", "PrometheusExporter", "Sample", "metrics_snapshot"]


@attrs.frozen(kw_only=True)
class Sample:
    """One metric value.

    Attributes:
        name: series name without prefix (counters end in ``_total``).
        kind: ``"counter"`` (only grows), ``"gauge"``, or ``"histogram"`` (cumulative
            ``*_bucket`` counts with an ``le`` label, and ``*_sum``).
        help: one-line description, with units.
        value: the value (bytes, seconds or a count).
        labels: label name -> value.
    """

    name: str
    kind: str
    help: str
    value: float
    labels: Mapping[str, str] = attrs.field(factory=dict)


@attrs.frozen
class MetricsSnapshot:
    """Every sample of one statistics reading, in a fixed order."""

    samples: tuple[Sample, ...]

    def value(self, name: str, **labels: str) -> float:
        """The value of series ``name`` with exactly ``labels``.

        Raises:
            KeyError: no such series.
        """
        for sample in self.samples:
            if sample.name == name and dict(sample.labels) == labels:
                return sample.value
        raise KeyError(f"no metric {name} with labels {labels}")

    def as_dict(self, prefix: str = "kvmgr") -> dict[str, float]:
        """``{'kvmgr_evictions_total{policy="lru"}': 3.0, ...}``, keys as Prometheus prints them."""
        out = {}
        for s in self.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
            out[f"{prefix}_{s.name}" + (f"{{{labels}}}" if labels else "")] = s.value
        return out


def metrics_snapshot(source: OffloadManager | ManagerStatistics) -> MetricsSnapshot:
    """Read the metrics of a manager (its ``statistics()`` now) or of a statistics value."""
    st = source if isinstance(source, ManagerStatistics) else source.statistics()
    samples: list[Sample] = []

    def add(name: str, kind: str, help: str, value: float, **labels: str) -> None:
        samples.append(Sample(name=name, kind=kind, help=help, value=float(value), labels=labels))

    _add_counters(st, add)
    _add_gauges(st, add)
    _add_histograms(st, add)
    if st.gpu_blocks_free is not None:
        add("gpu_blocks_free", "gauge", "free blocks of the owned GPU pool", st.gpu_blocks_free)
    return MetricsSnapshot(tuple(samples))


_Add = Callable[..., None]  # add(name, kind, help, value, **labels)


def _add_counters(st: ManagerStatistics, add: _Add) -> None:
    counter = "counter"
    add("lookups_total", counter, "lookup calls", st.lookups)
    add("lookup_keys_total", counter, "keys asked by lookups", st.lookup_keys)
    add("lookup_hits_total", counter, "keys found READY by lookups", st.lookup_hits)
    add("lookup_misses_total", counter, "keys asked and not hit", st.lookup_keys - st.lookup_hits)
    add("peeks_total", counter, "peek calls (they touch nothing)", st.peeks)
    add("evictions_total", counter, "CPU blocks evicted", st.evictions, policy=st.policy)
    add("invalidated_total", counter, "keys dropped by invalidate/clear", st.invalidated)
    rejected = {"cpu_full": 0, "timeout": 0, **st.rejected}
    for reason, count in sorted(rejected.items()):
        add("stores_rejected_total", counter, "stores refused, by reason", count, reason=reason)
    add("await_timeouts_total", counter, "awaits that passed their deadline", st.await_timeouts)
    add("events_dropped_total", counter, "KV events dropped undrained", st.events_dropped)
    stored = dict(queued=st.stores_queued, completed=st.stores_completed, failed=st.stores_failed)
    stored.update(skipped=st.stores_skipped, not_admitted=st.stores_not_admitted)
    for outcome, count in stored.items():
        add("blocks_stored_total", counter, "blocks stored (GPU -> CPU)", count, outcome=outcome)
    loaded = {"queued": st.loads_queued, "completed": st.loads_completed}
    loaded.update(failed=st.loads_failed)
    for outcome, count in loaded.items():
        add("blocks_loaded_total", counter, "blocks loaded (CPU -> GPU)", count, outcome=outcome)
    for direction, num_bytes, seconds in (
        ("d2h", st.bytes_d2h, st.device_s_d2h),
        ("h2d", st.bytes_h2d, st.device_s_h2d),
    ):
        add("transfer_bytes_total", counter, "bytes copied, bytes", num_bytes, direction=direction)
        add(
            "transfer_device_seconds_total",
            counter,
            "device seconds of completed copies, seconds",
            seconds,
            direction=direction,
        )
    add("steps_total", counter, "step() calls", st.steps)


def _add_gauges(st: ManagerStatistics, add: _Add) -> None:
    gauge = "gauge"
    add("copies_in_flight", gauge, "batches submitted and not completed", st.batches_in_flight)
    add("queued_swaps", gauge, "swaps waiting for the next flush", st.queued_swaps)
    add("stores_waiting", gauge, "stores waiting for room (backpressure)", st.stores_waiting)
    free = st.cpu_blocks_ready - st.cpu_blocks_used
    unpinned = st.cpu_blocks_total - st.cpu_blocks_ready
    add("cpu_blocks", gauge, "CPU tier blocks by state", st.cpu_blocks_used, state="used")
    add("cpu_blocks", gauge, "CPU tier blocks by state", free, state="free")
    add("cpu_blocks", gauge, "CPU tier blocks by state", unpinned, state="unpinned")
    pin_s = 0.0 if st.cpu_pinning is None else st.cpu_pinning.pin_s
    add("cpu_pin_seconds", gauge, "seconds spent page-locking the CPU tier so far", pin_s)
    add("cpu_keys", gauge, "keyed CPU blocks by state", st.cpu_keys_pending, state="pending")
    add("cpu_keys", gauge, "keyed CPU blocks by state", st.cpu_keys_ready, state="ready")
    add("cpu_keys", gauge, "keyed CPU blocks by state", st.cpu_keys_loading, state="loading")


def _add_histograms(st: ManagerStatistics, add: _Add) -> None:
    for name, hist, help_text in (
        ("batch_blocks", st.batch_blocks, "blocks per submitted batch, blocks"),
        ("completion_seconds", st.completion_s, "submission to completion per batch, seconds"),
    ):
        if hist is None:
            continue
        cumulative = 0
        for bound, count in zip((*hist.bounds, float("inf")), hist.counts):
            cumulative += count
            add(f"{name}_bucket", "histogram", help_text, cumulative, le=_le(bound))
        add(f"{name}_sum", "histogram", help_text, hist.total)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class PrometheusExporter:
    """A Prometheus collector for one manager: every scrape reads a fresh ``statistics()``.

    No background thread: ``collect()`` runs on the scraping thread. When that is not the
    manager's event-loop thread while the loop runs (``prometheus_client.start_http_server``),
    the reading is taken on the loop thread (``call_soon_threadsafe``) and waited for up to
    ``timeout_s``, because the manager is not thread-safe.

    Args:
        manager: the manager to export.
        registry: a ``prometheus_client.CollectorRegistry``; ``None`` = the default registry.
        prefix: prepended to every series name with ``_``.
        timeout_s: bound of the wait for the loop thread, seconds.

    Raises:
        ImportError: ``prometheus_client`` is not installed.
        ValueError: (from the registry) series of this prefix are already registered there.
    """

    def __init__(
        self,
        manager: OffloadManager,
        registry: Any = None,
        prefix: str = "kvmgr",
        timeout_s: float = 1.0,
    ) -> None:
        try:
            import prometheus_client
        except ImportError as exc:
            raise ImportError(
                "PrometheusExporter needs prometheus_client: pip install 'kvmgr[metrics]'"
            ) from exc
        self.manager = manager
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.registry = prometheus_client.REGISTRY if registry is None else registry
        self.registry.register(self)

    def unregister(self) -> None:
        """Remove this collector from its registry."""
        self.registry.unregister(self)

    def _statistics(self) -> ManagerStatistics:
        loop = self.manager._loop
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if loop is None or on_loop or not loop.is_running():
            return self.manager.statistics()
        result: concurrent.futures.Future[ManagerStatistics] = concurrent.futures.Future()

        def read() -> None:
            try:
                result.set_result(self.manager.statistics())
            except BaseException as exc:  # hand any failure to the scraping thread
                result.set_exception(exc)

        loop.call_soon_threadsafe(read)
        return result.result(timeout=self.timeout_s)

    def describe(self) -> Iterator[Any]:
        """The metric families (so the registry can check for duplicate names)."""
        return self.collect()

    def collect(self) -> Iterator[Any]:
        """One metric family per series name, read from a fresh snapshot."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        families: dict[str, Any] = {}
        samples = metrics_snapshot(self._statistics()).samples
        buckets: dict[str, list[tuple[str, float]]] = {}
        sums: dict[str, float] = {}
        helps: dict[str, str] = {}
        for s in samples:
            if s.kind != "histogram":
                continue
            base, _, suffix = s.name.rpartition("_")
            helps[base] = s.help
            if suffix == "bucket":
                buckets.setdefault(base, []).append((s.labels["le"], s.value))
            else:
                sums[base] = s.value
        for base, series in buckets.items():
            families[base] = HistogramMetricFamily(
                f"{self.prefix}_{base}", helps[base], buckets=series, sum_value=sums.get(base, 0.0)
            )
        for s in samples:
            if s.kind == "histogram":
                continue
            family = families.get(s.name)
            if family is None:
                kind = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                family = kind(f"{self.prefix}_{s.name}", s.help, labels=list(s.labels))
                families[s.name] = family
            family.add_metric(list(s.labels.values()), s.value)
        return iter(families.values())
