"""End to end: the example engine on a slice of the Mooncake trace, with and without kvmgr.

Run from the repository root::

    python -m examples.engine.bench            # Llama-3-8B shapes, random bf16, on a CUDA GPU
    python -m examples.engine.bench --tiny     # a tiny model on the CPU, seconds
    python -m examples.engine.bench --json out.json

Variants, one process, same requests, same GPU KV tensors:
    (a) recompute: no CPU tier; a preempted request recomputes; no prefix reuse
    (b) auto:      kvmgr CPU tier, ``engine="auto"`` (per-batch DMA or copy kernel)
    (c) cuda:      kvmgr CPU tier, ``engine="cuda"`` (batched driver copies); skipped on CPU
    (d) <engine>-layerwise (e.g. ``auto-layerwise``): prefix hits load layer by layer in the step
        that computes their suffix (``OffloadManager.load_layerwise``)
On a GPU, decode-only steps run in CUDA graphs (``graphs.py``; ``--eager-decode``: not). After
the variants, ``probe.hit_probe`` times one hit as load alone, suffix compute alone and
layerwise (``--no-probe`` skips it). ``--slice multiturn`` replaces the trace by synthetic
conversations whose every turn extends the previous prompt (high reuse).

Trace: the bundled Mooncake conversation trace; its ``hash_ids`` name 512-token blocks. Each
hash id gets deterministic token ids (a generator seeded by the id), so requests sharing a
prefix of hash ids share their token prefix and hence kvmgr keys. Prompts are capped at
``--max-prompt-blocks`` trace blocks and outputs at ``--max-output`` tokens; arrival times
are rescaled to ``--rate`` requests/s (above the GPU's capacity: the queue never empties).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from typing import Any

import numpy as np
import torch

from examples.engine.engine import Engine, EngineConfig, Request
from examples.engine.model import LLAMA3_8B, ModelConfig, PagedDecoder, new_kv_caches
from examples.engine.probe import hit_probe
from kvmgr import ManagerConfig, OffloadManager, __version__
from kvmgr.sim import default_trace_path, load_trace

TINY = ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, intermediate_size=128)  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.engine.bench", description=__doc__)
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU (a smoke run)")
    p.add_argument(
        "--slice",
        choices=("mooncake", "multiturn"),
        default="mooncake",
        help="requests: the Mooncake trace slice, or synthetic multi-turn conversations (each "
        "turn's prompt = the previous turn's prompt + --turn-tokens new tokens: high reuse)",
    )
    p.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    p.add_argument("--turn-gap", type=float, default=1.0, help="multiturn: seconds between turns")
    p.add_argument("--requests", type=int, default=None, help="requests from the trace")
    p.add_argument("--start", type=int, default=0, help="first trace line used")
    p.add_argument("--max-prompt-blocks", type=int, default=3, help="trace blocks per prompt")
    p.add_argument("--trace-block-tokens", type=int, default=None, help="tokens per hash id")
    p.add_argument("--max-output", type=int, default=None, help="output tokens cap")
    p.add_argument("--rate", type=float, default=None, help="arrivals, requests/s")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--token-budget", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--gpu-kv-gib", type=float, default=None, help="GPU KV cache size")
    p.add_argument("--cpu-kv-gib", type=float, default=None, help="CPU tier size")
    p.add_argument(
        "--variants",
        default="recompute,auto,cuda",
        help="comma-separated: recompute, auto, cuda, kernel; a -layerwise suffix (auto-layerwise)"
        " loads prefixes layer by layer",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="run every variant this many times in turn and report the last round (the first "
        "pays one-time compilation and allocator warm-up, which favours whoever runs later)",
    )
    p.add_argument(
        "--eager-decode",
        action="store_true",
        help="decode eagerly on the GPU too (default there: decode-only steps in CUDA graphs)",
    )
    p.add_argument(
        "--no-probe", action="store_true", help="skip the hit probe (load / compute / layerwise)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--probe-engines", default="",
        help="comma-separated engines (cuda, kernel) whose hit probe (8 groups) also runs",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    tiny = {
        "requests": 40,
        "trace_block_tokens": 32,
        "max_output": 4,
        "rate": 400.0,
        "token_budget": 128,
        "gpu_kv_gib": 0.25 / 1024,
        "cpu_kv_gib": 2 / 1024,
    }
    full = {"requests": 200, "trace_block_tokens": 512, "max_output": 16, "rate": 24.0,
            "token_budget": 2048, "gpu_kv_gib": 4.0, "cpu_kv_gib": 8.0}  # fmt: skip
    for name, value in (tiny if args.tiny else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[Request]:
    """The trace slice as requests: synthesised prompts, capped lengths, rescaled arrivals."""
    if args.slice == "multiturn":
        return make_multiturn(args, vocab_size)
    trace = load_trace(default_trace_path(), limit=args.start + args.requests)[args.start :]
    tb = args.trace_block_tokens
    blocks: dict[int, list[int]] = {}
    requests = []
    t0, span = trace[0].arrival_s, max(trace[-1].arrival_s - trace[0].arrival_s, 1e-9)
    scale = (len(trace) / args.rate) / span  # seconds of the run per second of the trace
    for i, row in enumerate(trace):
        ids = row.hash_ids[: args.max_prompt_blocks]
        for h in ids:
            if h not in blocks:  # the tokens of a hash id depend on the id alone
                blocks[h] = (
                    np.random.default_rng([args.seed, h]).integers(1, vocab_size, tb).tolist()
                )
        length = min(-(-row.input_length * tb // 512), len(ids) * tb)
        prompt = [t for h in ids for t in blocks[h]][: max(length, 2)]
        out = min(row.output_length, args.max_output)
        requests.append(Request(i, prompt, out, arrival_s=(row.arrival_s - t0) * scale))
    return requests


def make_multiturn(args: argparse.Namespace, vocab_size: int) -> list[Request]:
    """``--requests`` requests as conversations of ``--turns`` turns: the first prompt is
    ``--max-prompt-blocks`` trace blocks of tokens, every later turn adds one more block;
    conversations arrive at ``--rate`` / ``--turns`` per second, their turns ``--turn-gap``
    seconds apart. Token ids from a generator seeded by (seed, conversation)."""
    tb, turns = args.trace_block_tokens, max(1, args.turns)
    conversations = max(1, args.requests // turns)
    first = args.max_prompt_blocks * tb
    requests = []
    for c in range(conversations):
        rng = np.random.default_rng([args.seed, 1 << 20, c])
        tokens = rng.integers(1, vocab_size, first + turns * tb).tolist()
        start = c * turns / args.rate
        for k in range(turns):
            prompt = tokens[: first + k * tb]
            arrival = start + k * args.turn_gap
            requests.append(Request(len(requests), prompt, args.max_output, arrival_s=arrival))
    return requests


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def run_variant(
    name: str,
    model: PagedDecoder,
    kv: list[torch.Tensor],
    args: argparse.Namespace,
    cpu_blocks: int,
) -> dict[str, Any]:
    offload = name != "recompute"
    layerwise = name.endswith("-layerwise")  # e.g. "auto-layerwise": prefixes load layer by layer
    engine_name = "auto" if name == "recompute" else name.removesuffix("-layerwise")
    config = ManagerConfig(num_cpu_blocks=cpu_blocks if offload else 1, engine=engine_name)
    requests = make_requests(args, model.config.vocab_size)
    econf = EngineConfig(
        block_size=args.block_size,
        token_budget=args.token_budget,
        max_num_seqs=args.max_num_seqs,
        offload=offload,
        realtime=True,
        layerwise=layerwise,
        decode_graphs=kv[0].is_cuda and not args.eager_decode,
    )
    async with OffloadManager(kv, config) as mgr:
        warm = [Request(-1 - i, r.prompt, 2) for i, r in enumerate(requests[:2])]
        await Engine(model, kv, mgr, EngineConfig(block_size=args.block_size, offload=False)).run(
            warm
        )
        engine = Engine(model, kv, mgr, econf)
        stats = await engine.run(requests)
        ms = mgr.statistics()
    ttft = [r.first_token_s - r.arrival_s for r in requests if r.first_token_s is not None]
    outputs = sum(len(r.output) for r in requests)
    return {
        "variant": name,
        "engine": ms.engine,
        "requests": len(requests),
        "wall_s": stats.wall_s,
        "requests_per_s": len(requests) / stats.wall_s,
        "output_tokens_per_s": outputs / stats.wall_s,
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "prefill_tokens": stats.prefill_tokens,
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "hit_tokens": stats.hit_tokens,
        "preemptions": stats.preemptions,
        "recompute_preemptions": stats.recompute_preemptions,
        "stores_rejected": stats.stores_rejected,
        "steps": stats.steps,
        "offload_host_share": stats.kvmgr_host_s / stats.wall_s,
        "offload_host_us_per_step": 1e6 * stats.kvmgr_host_s / max(stats.steps, 1),
        "forward_share": stats.forward_s / stats.wall_s,
        "graph_steps": stats.graph_steps,
        "offload_device_share": (ms.device_s_d2h + ms.device_s_h2d) / stats.wall_s,
        "bytes_d2h": ms.bytes_d2h,
        "bytes_h2d": ms.bytes_h2d,
        "layerwise_steps": stats.layerwise_steps,
        "layerwise_step_s": stats.layerwise_step_s,
        "layerwise_load_s": stats.layerwise_load_s,
        "layerwise_failed": stats.layerwise_failed,
        "layerwise_stores": stats.layerwise_stores,
        # a layerwise step against its own loads' device time (1.0: the step took the load's time)
        "layerwise_step_over_load": (
            stats.layerwise_step_s / stats.layerwise_load_s if stats.layerwise_load_s else None
        ),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("no CUDA GPU: run with --tiny for the CPU smoke run", file=sys.stderr)
        return 2
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    mconf = LLAMA3_8B if cuda else TINY
    model = PagedDecoder.random(mconf, seed=args.seed, dtype=dtype, device=device)
    block_bytes = 2 * mconf.num_layers * args.block_size * mconf.num_kv_heads * mconf.head_dim
    block_bytes *= torch.finfo(dtype).bits // 8
    gpu_blocks = int(args.gpu_kv_gib * 2**30 // block_bytes)
    cpu_blocks = int(args.cpu_kv_gib * 2**30 // block_bytes)
    kv = new_kv_caches(mconf, gpu_blocks, args.block_size, dtype, device)
    variants = [v for v in args.variants.split(",") if cuda or v != "cuda"]
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "kvmgr": __version__,
        "model": "llama3-8b-shaped random bf16" if cuda else "tiny random fp32",
        "gpu_blocks": gpu_blocks,
        "cpu_blocks": cpu_blocks,
        "block_size": args.block_size,
        "slice": args.slice,
        "args": vars(args),
    }
    results: list[dict[str, Any]] = []
    for round_index in range(max(1, args.rounds)):
        results = []
        for name in variants:
            start = time.perf_counter()
            results.append(asyncio.run(run_variant(name, model, kv, args, cpu_blocks)))
            results[-1]["round"] = round_index
            print(
                f"round {round_index} {name}: done in {time.perf_counter() - start:.1f} s: "
                f"{results[-1]}",
                file=sys.stderr,
            )
            if args.json:  # after every variant, so that a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"meta": meta, "results": results}, f, indent=2)
    if not args.no_probe:  # one hit timed three ways, same process (probe.py)
        tb = args.trace_block_tokens
        probes = [("hit_probe", 8, "auto"), ("hit_probe_per_layer", mconf.num_layers, "auto")]
        probes += [(f"hit_probe_{e}", 8, e) for e in args.probe_engines.split(",") if e]
        for key, groups, engine in probes:
            meta[key] = asyncio.run(
                hit_probe(
                    model,
                    kv,
                    block_size=args.block_size,
                    prefix_blocks=args.max_prompt_blocks * tb // args.block_size,
                    suffix_tokens=tb,
                    engine=engine if cuda else "host",
                    max_groups=groups,
                )
            )
            print(f"{key}: {json.dumps(meta[key])}", file=sys.stderr)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=2)
    print_table(results, meta)
    return 0


def print_table(results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    print(f"# {meta['model']} on {meta['device']}, {meta['gpu_blocks']} GPU blocks, "
          f"{meta['cpu_blocks']} CPU blocks of {meta['block_size']} tokens")  # fmt: skip
    rows = [
        ("requests/s", "requests_per_s", "{:.2f}"),
        ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
        ("TTFT p50 s", "ttft_p50_s", "{:.3f}"),
        ("TTFT p99 s", "ttft_p99_s", "{:.3f}"),
        ("prefill tokens computed", "prefill_tokens", "{:d}"),
        ("prefix tokens loaded", "hit_tokens", "{:d}"),
        ("preemptions (recomputed)", None, None),
        ("offload share, host", "offload_host_share", "{:.1%}"),
        ("offload host us per step", "offload_host_us_per_step", "{:.0f}"),
        ("forward share (model + sampling)", "forward_share", "{:.1%}"),
        ("decode steps in CUDA graphs", "graph_steps", "{:d}"),
        ("offload share, copy device time", "offload_device_share", "{:.1%}"),
        ("wall s", "wall_s", "{:.1f}"),
    ]
    print("| metric | " + " | ".join(r["variant"] for r in results) + " |")
    print("| --- |" + " --- |" * len(results))
    for label, key, fmt in rows:
        if key is None:
            cells = [f"{r['preemptions']} ({r['recompute_preemptions']})" for r in results]
        else:
            cells = [fmt.format(r[key]) for r in results]
        print(f"| {label} | " + " | ".join(cells) + " |")
    for probe in [v for k, v in meta.items() if k.startswith("hit_probe")]:
        if not probe:
            continue
        print(f"hit of {probe['prefix_blocks']} blocks + {probe['suffix_tokens']} tokens, "
              f"engine {probe['engine']}, {probe['max_groups']} groups at most: load "
              f"{probe['load_s'] * 1e3:.2f} ms, suffix compute {probe['compute_s'] * 1e3:.2f} ms, "
              f"layerwise {probe['layerwise_s'] * 1e3:.2f} ms = {probe['ratio']:.2f}x "
              "max(load, compute) (goal <= 1.1)")  # fmt: skip
    base = results[0]
    for r in results[1:]:
        print(f"{r['variant']} / {base['variant']}: throughput "
              f"{r['requests_per_s'] / base['requests_per_s']:.2f}x, TTFT p99 "
              f"{r['ttft_p99_s'] / base['ttft_p99_s']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
