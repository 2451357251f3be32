"""A synthetic multi-turn chat trace in the Mooncake format, seeded and deterministic.

Offers:
    SynthConfig     the knobs of the generator (frozen; defaults give ~1 hour, ~12k requests)
    synth_trace     the trace as ``TraceRequest`` objects, sorted by arrival
    write_trace     write it as Mooncake JSON lines (``.gz``: gzip, byte-identical per seed)
    add_arguments / run   ``kvmgr synth-trace``: write a trace file

Model (written from first principles, never fitted to the bundled trace, and kept out of every
policy's tuning so that it is a held-out workload):

- Conversations start as a Poisson process (``conversations_per_s``). Each picks one of
  ``num_system_prompts`` system prompts by a Zipf law (exponent ``zipf_s``); a system prompt is
  a fixed run of 1-8 trace blocks shared by every conversation that picks it.
- A conversation has a hidden *kind*: with probability ``chatty_fraction`` it continues after
  each turn with probability ``chatty_continue`` and its user thinks for a lognormal time of
  median ``chatty_think_s``; otherwise with ``casual_continue`` and ``casual_think_s``. Think
  times have log-sigma ``think_sigma``. The next turn arrives after the previous answer was
  generated (``output_length / decode_tokens_per_s``) plus the think time.
- The first turn may attach a document (probability ``document_probability``, lognormal
  tokens of median ``document_tokens``); every turn adds a user message (lognormal, median
  ``message_tokens``) and the previous answer. Outputs are lognormal (median
  ``output_tokens``). A conversation stops when its prompt would exceed ``max_prompt_tokens``.
- Turn ``k + 1``'s prompt is turn ``k``'s prompt, its answer and the new message, so its
  ``hash_ids`` repeat turn ``k``'s full blocks; every other block gets a fresh id.

Everything is drawn from one ``numpy.random.Generator(PCG64(seed))`` in a fixed order, so a seed
gives the same requests on every machine.
"""

from __future__ import annotations

import argparse
import gzip
import heapq
import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kvmgr.sim.trace import TRACE_BLOCK_TOKENS, TraceRequest

__all__ = ["SynthConfig", "add_arguments", "run", "synth_trace", "write_trace"]


@attrs.frozen(kw_only=True)
class SynthConfig:
    """Knobs of `synth_trace` (times in seconds, lengths in tokens); see the module docstring.

    Raises:
        ValueError: a non-positive duration, rate or length, or a probability outside [0, 1].
    """

    seed: int = 0
    duration_s: float = 3600.0
    conversations_per_s: float = 1.3
    num_system_prompts: int = 24
    zipf_s: float = 1.1
    chatty_fraction: float = 0.35
    chatty_continue: float = 0.8
    casual_continue: float = 0.3
    chatty_think_s: float = 90.0
    casual_think_s: float = 300.0
    think_sigma: float = 1.0
    document_probability: float = 0.6
    document_tokens: float = 12000.0
    message_tokens: float = 800.0
    output_tokens: float = 300.0
    decode_tokens_per_s: float = 30.0
    max_prompt_tokens: int = 65536

    def __attrs_post_init__(self) -> None:
        positive = ("duration_s", "conversations_per_s", "num_system_prompts", "zipf_s")
        positive += ("chatty_think_s", "casual_think_s", "document_tokens", "message_tokens")
        positive += ("output_tokens", "decode_tokens_per_s", "max_prompt_tokens")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)!r}")
        for name in ("chatty_fraction", "chatty_continue", "casual_continue"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: expected a probability, got {getattr(self, name)!r}")
        if self.document_probability < 0 or self.document_probability > 1:
            raise ValueError(
                f"document_probability: expected [0, 1], got {self.document_probability}"
            )


def _lognormal(rng: np.random.Generator, median: float, sigma: float, low: int, high: int) -> int:
    return int(np.clip(round(median * float(np.exp(sigma * rng.standard_normal()))), low, high))


_Turn = tuple[float, int, dict[str, Any]]  # (arrival, tie-break, conversation state)


@attrs.define
class _Ids:
    """Fresh block ids, counted from 0."""

    next_id: int = 0

    def fresh(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids


def synth_trace(config: SynthConfig | None = None) -> list[TraceRequest]:
    """Generate the trace of ``config`` (default `SynthConfig()`), sorted by arrival.

    Returns:
        Requests with ``hash_ids`` of ``TRACE_BLOCK_TOKENS``-token blocks (the last one partial
        when ``input_length`` is not a multiple), ``arrival_s`` from 0.
    """
    c = config if config is not None else SynthConfig()
    rng = np.random.Generator(np.random.PCG64(c.seed))
    ids, serial = _Ids(), itertools.count()
    pending = _openings(c, rng, ids, serial)  # a heap of pending turns
    requests: list[TraceRequest] = []
    while pending:
        arrival, _, state = heapq.heappop(pending)
        tokens = state["base"] + _lognormal(rng, c.message_tokens, 1.0, 8, 16_000)
        if tokens > c.max_prompt_tokens:
            continue
        output = _lognormal(rng, c.output_tokens, 0.7, 8, 4096)
        kept = state["ids"][: tokens // TRACE_BLOCK_TOKENS]
        hash_ids = kept + ids.fresh(-(-tokens // TRACE_BLOCK_TOKENS) - len(kept))
        requests.append(TraceRequest(arrival, tokens, output, tuple(hash_ids)))
        chatty = state["chatty"]
        if rng.random() < (c.chatty_continue if chatty else c.casual_continue):
            think = c.chatty_think_s if chatty else c.casual_think_s
            gap = output / c.decode_tokens_per_s + _lognormal(rng, think, c.think_sigma, 1, 10**6)
            if arrival + gap < c.duration_s:
                # the next prompt repeats this prompt's full blocks and continues after them
                full = list(hash_ids[: tokens // TRACE_BLOCK_TOKENS])
                state = {"chatty": chatty, "ids": full, "base": tokens + output}
                heapq.heappush(pending, (arrival + gap, next(serial), state))
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def _openings(
    c: SynthConfig, rng: np.random.Generator, ids: _Ids, serial: Iterator[int]
) -> list[_Turn]:
    """The first turn of every conversation (Poisson arrivals over ``duration_s``), as a heap;
    each opens with one of the shared system prompts (Zipf popularity), maybe a document."""
    weights = 1.0 / np.arange(1, c.num_system_prompts + 1) ** c.zipf_s
    weights /= weights.sum()
    system = [ids.fresh(int(rng.integers(1, 9))) for _ in range(c.num_system_prompts)]
    pending: list[_Turn] = []
    t = 0.0
    while True:
        t += float(rng.exponential(1.0 / c.conversations_per_s))
        if t >= c.duration_s:
            return pending
        chatty = bool(rng.random() < c.chatty_fraction)
        prompt = int(rng.choice(c.num_system_prompts, p=weights))
        tokens = len(system[prompt]) * TRACE_BLOCK_TOKENS
        if rng.random() < c.document_probability:
            tokens += _lognormal(rng, c.document_tokens, 0.8, 256, 48_000)
        state = {"chatty": chatty, "ids": list(system[prompt]), "base": tokens}
        heapq.heappush(pending, (t, next(serial), state))


def write_trace(requests: list[TraceRequest], path: str | Path) -> Path:
    """Write ``requests`` as Mooncake JSON lines (``timestamp`` in integer ms); ``.gz`` gzips
    without a timestamp in the header, so equal requests give equal bytes."""
    lines = [
        json.dumps(
            {
                "timestamp": round(r.arrival_s * 1000),
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
        )
        for r in requests
    ]
    data = ("\n".join(lines) + "\n").encode()
    out = Path(path)
    if out.suffix == ".gz":
        data = gzip.compress(data, compresslevel=9, mtime=0)
    out.write_bytes(data)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvmgr synth-trace``."""
    parser.add_argument("out", type=Path, help="output file (.jsonl, or .jsonl.gz)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed")
    parser.add_argument("--duration-s", type=float, default=3600.0, help="trace length")


def run(args: argparse.Namespace) -> int:
    """Write the trace; exit status 0, or 2 on bad input."""
    try:
        requests = synth_trace(SynthConfig(seed=args.seed, duration_s=args.duration_s))
        write_trace(requests, args.out)
    except (ValueError, OSError) as exc:
        print(f"kvmgr synth-trace: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {len(requests):,} requests")
    return 0
