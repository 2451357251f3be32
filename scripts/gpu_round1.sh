#!/usr/bin/env bash
# First consolidated GPU call of the session (2026-12-01): GPU tests, host path, quick benches.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
run() { local name=$1 secs=$2; shift 2; echo "=== $name ($(date -u +%T))"; timeout "$secs" "$@" >"$OUT/$name.log" 2>&1; local rc=$?; tail -n "${TAIL:-12}" "$OUT/$name.log"; echo "=== $name rc=$rc"; }
TAIL=4 run env 30 bash -c 'nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)"; python3 -c "import transformers; print(transformers.__version__)"'
TAIL=40 run pytest_gpu 180 python3 -m pytest -q -rf -p no:cacheprovider -m gpu -x --timeout 120 tests
TAIL=30 run bench_host 100 python3 -m kvmgr.cli bench host --rounds 200 --steps 2000 --json "$OUT/host.json"
TAIL=45 run bench_swap 90 python3 -m kvmgr.cli bench swap --geometries qwen llama --blocks 512 --repeats 5 --warmup 1 --variants batch_ctypes kernel auto --json "$OUT/swap.json"
TAIL=30 run bench_mla 60 python3 -m kvmgr.cli bench mla-insert --tokens 1,16,128,512,16384 --reps 15 --json "$OUT/mla.json"
TAIL=30 run bench_c128 50 python3 -m kvmgr.cli bench c128 --repeats 7 --steps 100 --json "$OUT/c128.json"
TAIL=30 run peer_swap 70 python3 -c "import argparse, sys; from kvmgr.bench.peer_swap import run_peer_swap; r = run_peer_swap(argparse.Namespace(swap_repeats=5, swap_warmup=1, swap_json='$OUT/peer_swap.json')); sys.exit(0 if r['ok'] else 1)"
