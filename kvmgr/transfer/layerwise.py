"""Layerwise loads and stores: one batch per layer (or group of layers), one event each.

Offers:
    LayerBatches    the per-group batches of one load or store, joined into one ``BatchHandle``
                    (re-exported from ``kvmgr.transfer.layer_batches``)
    LayerwiseLoad   a load split by layer: ``wait_layer(i)`` before layer ``i`` reads its KV
    LayerwiseStore  a store split by layer: ``save_layer(i)`` once layer ``i`` wrote its KV

Layers and their groups: ``kvmgr.transfer.layer_groups``. A load of ``n`` blocks over ``L``
layers is submitted as ``G <= L`` batches, group ``0`` first,
on the engine's load stream (one stream, so they run and end in that order). The model calls
``load.wait_layer(i)`` right before layer ``i``'s attention reads the KV: the compute stream
waits on the device for the end event of the group holding layer ``i`` (no host sync), so the
copy of layer ``i + 1`` runs under layer ``i``'s compute (SGLang HiCache's per-layer events,
vLLM's ``wait_for_layer_load``). A store calls ``store.save_layer(i)`` right after layer ``i``
wrote its KV: the group's batch is submitted there, fenced on the compute stream at that point
(vLLM's ``save_kv_layer``).

All or nothing: a load whose any group failed (refused at submit, or failed on the device) fails
as a whole. Every group is submitted before ``load_layerwise`` returns, so a refused submit is
known before the first ``wait_layer``, which then raises ``LayerLoadError``: the forward never
reads a layer of a failed load. A store fails the same way, with ``LayerStoreError`` (a
subclass of ``LayerLoadError``, so older ``except LayerLoadError`` still catch it;
``LayerwiseError`` is the base of both). A device-side copy fault is a sticky CUDA error: the
context is lost and nothing reads anything afterwards.

CUDA graphs: neither call is capturable (``wait_layer`` waits on an event recorded outside the
graph; ``save_layer`` submits host-side work); inside a capture both raise ``LayerOrderError``.
Call them in the eager pieces of a piecewise graph (vLLM runs attention there); everything
between them (projections, MLP, norms) may be captured. With the host engine (no streams)
``wait_layer`` blocks the caller until the group's copy ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvmgr.errors import ClosedError, LayerLoadError, LayerOrderError
from kvmgr.transfer.engine import BatchHandle, TransferEngine
from kvmgr.transfer.layer_batches import LayerBatches
from kvmgr.transfer.layer_groups import LayerGroups

__all__ = ["LayerBatches", "LayerwiseLoad", "LayerwiseStore"]


def _check_not_capturing(what: str) -> None:
    if torch.cuda.is_current_stream_capturing():
        raise LayerOrderError(
            f"{what} is not capturable in a CUDA graph: call it in an eager piece of a piecewise "
            "graph (between captured regions)"
        )


def _layer_index(layer: object, num_layers: int, outside: str) -> int:
    """``layer`` as an int in ``[0, num_layers)``, else ``LayerOrderError`` (``outside`` words
    the message for an int out of range)."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise LayerOrderError(f"expected an int layer, got {type(layer).__name__}: {layer!r:.40}")
    if not 0 <= layer < num_layers:
        raise LayerOrderError(f"layer {layer} {outside} layers 0..{num_layers - 1}")
    return int(layer)


class LayerwiseLoad:
    """A load split by layer (module docstring). Built by ``OffloadManager.load_layerwise``.

    Attributes:
        groups: the layer groups.
        batches: the per-group batches.
        future: the manager's ``asyncio`` future of the load (``LoadResult``), resolved after
            every group ended and the bookkeeping ran; fails with ``LayerLoadError`` if any
            group failed.
    """

    def __init__(
        self,
        engine: TransferEngine,
        groups: LayerGroups,
        batches: LayerBatches,
        future: Any,
        is_open: Callable[[], bool],
    ) -> None:
        self.engine = engine
        self.groups = groups
        self.batches = batches
        self.future = future
        self._is_open = is_open
        self._waited = -1  # highest layer waited for
        self._waited_group = -1  # the group of the last wait issued, and its stream argument
        self._waited_stream: Any = None
        self._layer_group = groups.layer_group
        self._num_layers = groups.num_layers
        self._cuda = torch.cuda.is_available()  # no CUDA: nothing can be capturing
        self._closed = False

    @property
    def num_layers(self) -> int:
        """Layers the load covers."""
        return self.groups.num_layers

    def __await__(self) -> Any:
        return self.future.__await__()

    def done(self) -> bool:
        """Whether every group ended and the load's future resolved."""
        return bool(self.future.done())

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (default: the engine's compute stream, else the current one) wait on
        the device until layer ``layer``'s KV (and every earlier layer's) has landed; the host
        does not block (with the host engine it does: there are no streams).

        Call it right before layer ``layer``'s attention reads the loaded blocks; layers are
        waited for in order (waiting for a layer again is a no-op).

        Raises:
            LayerOrderError: ``layer`` is not a layer of the load, is below a layer already
                waited for, or the current stream is capturing a CUDA graph.
            LayerLoadError: the load failed (some group): do not read any of its blocks.
            ClosedError: the handle or its manager is closed.
        """
        if self._closed or not self._is_open():
            raise ClosedError("the layerwise load (or its manager) is closed")
        if type(layer) is not int or not 0 <= layer < self._num_layers:
            layer = _layer_index(layer, self._num_layers, "is not scheduled: the load covers")
        if layer < self._waited:
            raise LayerOrderError(
                f"layer {layer} waited for after layer {self._waited}: wait in layer order"
            )
        if self._cuda:
            _check_not_capturing("wait_layer")
        batches = self.batches
        if batches.error is not None:
            raise LayerLoadError(f"the layerwise load failed: {batches.error}")
        group = self._layer_group[layer]
        if group == self._waited_group and stream is self._waited_stream:
            self._waited = layer  # the group's wait was issued on this stream already
            return
        handle = batches.handles[group]
        if handle.end_event is None:  # the host engine: block until the group's copy ended
            error = handle.future.exception()
            if error is not None or batches.failed:
                raise LayerLoadError(f"the layerwise load failed: {batches.error or error}")
        else:
            if handle.future.done() and handle.future.exception() is not None:
                raise LayerLoadError(f"the layerwise load failed: {batches.error}")
            self.engine.stream_wait(handle, stream)
        self._waited, self._waited_group, self._waited_stream = layer, group, stream

    def wait_all(self, stream: Any = None) -> None:
        """``wait_layer`` of the last layer (every layer's KV has then landed on the device)."""
        self.wait_layer(self.num_layers - 1, stream)

    def close(self) -> None:
        """Stop using the handle (the copies and the load's future go on). Idempotent."""
        self._closed = True


class LayerwiseStore:
    """A store split by layer (module docstring). Built by ``OffloadManager.store_layerwise``.

    Attributes:
        groups: the layer groups.
        batches: the per-group batches.
        future: the manager's ``asyncio`` future of the store (``StoreResult``); it resolves
            after the last layer was saved and every group ended; fails with
            ``LayerStoreError`` if a group was refused or failed, or the store was aborted.
    """

    def __init__(
        self,
        groups: LayerGroups,
        batches: LayerBatches,
        future: Any,
        submit_group: Callable[[int], BatchHandle],
        is_open: Callable[[], bool],
    ) -> None:
        self.groups = groups
        self.batches = batches
        self.future = future
        self._submit_group = submit_group
        self._is_open = is_open
        self._next = 0  # the next layer to save
        self._aborted = False
        self._cuda = torch.cuda.is_available()  # no CUDA: nothing can be capturing

    @property
    def num_layers(self) -> int:
        """Layers the store covers."""
        return self.groups.num_layers

    @property
    def layers_saved(self) -> int:
        """Layers saved so far."""
        return self._next

    def __await__(self) -> Any:
        return self.future.__await__()

    def done(self) -> bool:
        """Whether the store's future resolved."""
        return bool(self.future.done())

    def save_layer(self, layer: int) -> None:
        """Layer ``layer`` wrote its KV: copy it out, after the work queued so far on the compute
        stream (a fence recorded there now). Layers are saved once each, in order; the group's
        batch is submitted when its last layer is saved. Once the store failed (a group was
        refused, or a submitted group's copy failed) or was aborted, this submits nothing: the
        forward goes on, and the store's future fails once the groups submitted ended.

        Raises:
            LayerOrderError: ``layer`` is not an int layer of the store, is not the next layer
                to save (or every layer was saved), or the current stream is capturing a CUDA
                graph.
            ClosedError: the manager is closed.
        """
        if not self._is_open():
            raise ClosedError("the layerwise store's manager is closed")
        if type(layer) is not int or not 0 <= layer < self.groups.num_layers:
            layer = _layer_index(
                layer, self.groups.num_layers, "is not a layer of the store, which covers"
            )
        if self._aborted or self.batches.error is not None:
            self.batches.close()  # a group failed: none follows; fails once those ended
            return
        if layer != self._next:
            expected = (
                "none: every layer was saved" if self._next >= self.num_layers else self._next
            )
            raise LayerOrderError(f"layer {layer} saved out of order: the next layer to save is {expected}")  # fmt: skip
        if self._cuda:
            _check_not_capturing("save_layer")
        self._next += 1
        groups = self.groups
        group = groups.layer_group[layer]
        if layer == groups.group_last[group]:
            self.batches.submit(group, lambda: self._submit_group(group))

    def abort(self) -> None:
        """Give up the layers not saved yet: the store fails (``LayerStoreError``) once the groups
        already submitted ended, and its keys are dropped. Idempotent; a no-op once complete."""
        if self._next < self.num_layers and not self._aborted:
            self._aborted = True
            self.batches.close()
