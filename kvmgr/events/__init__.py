"""KV events for routers: vLLM's wire format, a ZMQ publisher, the token ids a store carries.

Offers:
    VllmEventFormat     ``KVEvent`` -> vLLM's ``BlockStored`` / ``BlockRemoved`` /
                        ``AllBlocksCleared`` (``vllm_format.py``; needs msgspec)
    TierMedium          how one kvmgr tier is named in those events (medium, locality, ownership)
    encode_batch        one ``KVEventBatch`` as the msgpack bytes vLLM's publisher sends
    ZmqEventPublisher   vLLM's ZMQ PUB + ROUTER replay protocol (``zmq_publisher.py``; needs pyzmq)
    forward_events      publish a manager's KV event stream as it happens (``forward.py``)
    check_token_ids     a store's ``token_ids`` argument, validated (``tokens.py``)

The manager's in-process stream (``OffloadManager.take_events()`` / ``events()``) is unchanged;
this package is opt-in and imports msgspec and pyzmq only when its modules are used
(``pip install 'kvmgr[events]'``). docs/guides/router-events.md tells the whole story.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "TierMedium",
    "VllmEventFormat",
    "ZmqEventPublisher",
    "check_token_ids",
    "encode_batch",
    "forward_events",
]

_WHERE = {
    "TierMedium": "kvmgr.events.vllm_format",
    "VllmEventFormat": "kvmgr.events.vllm_format",
    "encode_batch": "kvmgr.events.vllm_format",
    "ZmqEventPublisher": "kvmgr.events.zmq_publisher",
    "forward_events": "kvmgr.events.forward",
    "check_token_ids": "kvmgr.events.tokens",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'kvmgr.events' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
