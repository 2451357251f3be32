"""What the scheduler tracks: requests, their states and keys, its settings and totals.

Offers:
    EngineConfig   block size, token budget, batch cap, whether the CPU tier is used
    Request        one request: prompt, outputs, timings, state, blocks, kvmgr keys
    EngineStats    what one run did (tokens computed, hits, preemptions, kvmgr host time)
    block_keys     chained block hashes of token ids (the keys kvmgr indexes)

States: WAITING -> (LOADING: prefix swap-in in flight) -> RUNNING -> FINISHED, and
RUNNING -> PREEMPTING (kvmgr preempt in flight) -> PREEMPTED -> RESUMING -> RUNNING.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import torch

__all__ = ["EngineConfig", "EngineStats", "Request", "block_keys"]

WAITING, LOADING, RUNNING, PREEMPTING, PREEMPTED, RESUMING, FINISHED = [
    "waiting",
    "loading",
    "running",
    "preempting",
    "preempted",
    "resuming",
    "finished",
]


def block_keys(token_ids: list[int], block_size: int) -> list[bytes]:
    """One key per full block: ``blake2b(parent_key + int64 token bytes)``, 16 bytes, so a key
    names the whole prefix up to its block (equal keys mean equal prefixes)."""
    keys, parent = [], b""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size].tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        keys.append(parent)
    return keys


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Scheduler settings.

    Attributes:
        block_size: tokens per KV block (dim 1 of the KV tensors).
        token_budget: new tokens computed per step, over all requests (chunked prefill).
        max_num_seqs: requests admitted at once (loading, running or preempted).
        offload: use kvmgr's CPU tier (prefix loads, stores, preempt/resume). False: no CPU
            tier; preemption frees the blocks and recomputes (the baseline).
        realtime: honour ``Request.arrival_s`` (seconds after the run starts).
        layerwise: load a hit's prefix layer by layer in the step that computes its suffix
            (``OffloadManager.load_layerwise``; the model waits for layer ``i`` before its
            attention), instead of loading the whole prefix first and computing a step later;
            and store the prompt blocks an eager step fills layer by layer as the forward writes
            them (``OffloadManager.store_layerwise``: ``save_layer(i)`` after layer ``i``'s
            attention), instead of one ``store_many`` after the forward.
        layer_groups: at most this many batches per layerwise load (``max_groups``: layers
            merged by size, each batch costs host time to submit).
        decode_graphs: run decode-only steps through ``graphs.DecodeGraphs`` (CUDA graphs on a
            GPU, the same static-shape code eagerly on the CPU).
    """

    block_size: int = 16
    token_budget: int = 512
    max_num_seqs: int = 64
    offload: bool = True
    realtime: bool = False
    layerwise: bool = False
    layer_groups: int = 8
    decode_graphs: bool = False


@dataclasses.dataclass(eq=False)
class Request:
    """One request. ``output`` holds the greedy tokens; ``first_logits`` the float32 logits
    ``[vocab]`` that produced ``output[0]``; times are seconds after the run started."""

    req_id: int
    prompt: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0
    output: list[int] = dataclasses.field(default_factory=list)
    first_logits: torch.Tensor | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    state: str = WAITING
    num_computed: int = 0
    block_ids: list[int] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)
    num_stored: int = 0
    pending: Any = None  # the future of a load, preempt or resume in flight

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclasses.dataclass
class EngineStats:
    """Totals of one run; ``*_s`` are wall-clock seconds."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    recompute_preemptions: int = 0
    stores_rejected: int = 0
    kvmgr_host_s: float = 0.0
    wall_s: float = 0.0
    layerwise_steps: int = 0  # steps that loaded a prefix layer by layer
    layerwise_step_s: float = 0.0  # their forward's wall time (waits on the loads included)
    layerwise_load_s: float = 0.0  # their loads' device time (summed over the layer groups)
    layerwise_failed: int = 0  # loads that failed (their requests recompute)
    layerwise_stores: int = 0  # store_layerwise calls (the forward saved each layer's K/V)
    graph_steps: int = 0  # decode steps run by DecodeGraphs
    forward_s: float = 0.0  # the model's forward + sampling sync, all steps
