#!/usr/bin/env bash
# One scripted GPU session on the lent H200: environment, GPU tests, benchmarks.
# Usage (on the device, from the repo root): bash scripts/gpu_run.sh SECTION...
#   sections: env kernels transfer manager bench-kernels bench-transfer sim docs engine
#   kernels: the kernel GPU tests, then short mla-insert / c128 benches and the peer MLA
#   baseline (all under 5 minutes); bench-kernels: the full kernel benches
# Logs and JSON go to $OUT (or ./out); each step has its own time limit and never stops the rest.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date -u +%T))"
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  tail -n "${TAIL:-15}" "$OUT/$name.log"; echo "=== $name rc=$rc"
}
for section in "$@"; do
  case $section in
    env)
      step env 60 bash -c 'nvidia-smi; python3 -c "import torch, triton, sys; print(sys.version); print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())"; python3 -m pip list 2>/dev/null | grep -iE "cuda|pytest|numpy|attrs|anyio|rich|hypothesis"' ;;
    kernels)
      TAIL=25 step pytest_kernels 140 python3 -m pytest -q -rf -p no:cacheprovider tests/kernels/test_mla_insert.py tests/kernels/test_c128.py tests/kernels/test_launch.py
      TAIL=40 step bench_mla_short 40 python3 -m kvmgr.cli bench mla-insert --tokens 1,16,128,512,16384 --reps 10 --rotate-mib 64 --json "$OUT/mla_insert_short.json"
      TAIL=45 step bench_c128_short 30 python3 -m kvmgr.cli bench c128 --batch 1 --prefill 1 1024 --repeats 7 --json "$OUT/c128_short.json"
      TAIL=30 step bench_peer_mla 90 python3 -m kvmgr.cli bench peer-mla --mla-json "$OUT/peer_mla.json" ;;
    transfer)  # issue 12, engines and submission: under 6 minutes in all (limits sum to 360 s)
      TAIL=60 step smoke_transfer 40 python3 scripts/gpu_smoke_transfer.py
      TAIL=40 step pytest_transfer 110 python3 -m pytest -q -rf -p no:cacheprovider tests/transfer/test_cuda_engine.py tests/kernels/test_copy_kernel.py tests/transfer/test_host_engine.py tests/transfer/test_plan.py
      TAIL=45 step bench_swap_quick 60 python3 -m kvmgr.cli bench swap --geometries qwen llama --blocks 512 --repeats 5 --warmup 1 --variants batch_c kernel auto --json "$OUT/swap_quick.json"
      TAIL=40 step bench_swap_kernel_quick 60 python3 -m kvmgr.cli bench swap-kernel --geometries qwen --blocks 512 --repeats 5 --warmup 1 --programs 8 16 32 --matmuls 10 --interference-repeats 3 --json "$OUT/swap_kernel_quick.json"
      TAIL=30 step bench_peer_swap 90 python3 -c "import argparse, sys; from kvmgr.bench.peer_swap import run_peer_swap; r = run_peer_swap(argparse.Namespace(swap_repeats=8, swap_warmup=2, swap_json='$OUT/peer_swap.json')); sys.exit(0 if r['ok'] else 1)" ;;
    manager)
      TAIL=12 step pytest_engines 200 python3 -m pytest -q -rf -p no:cacheprovider tests/manager/test_manager_engines.py
      TAIL=30 step pytest_all 420 python3 -m pytest -q -rf -p no:cacheprovider -x --ignore=tests/manager/test_manager_engines.py ;;
    bench-kernels)
      TAIL=70 step bench_mla 300 python3 -m kvmgr.cli bench mla-insert --tune --json "$OUT/mla_insert.json"
      TAIL=60 step bench_c128 240 python3 -m kvmgr.cli bench c128 --json "$OUT/c128.json" ;;
    bench-transfer)
      TAIL=70 step bench_swap 300 python3 -m kvmgr.cli bench swap --json "$OUT/swap.json"
      TAIL=60 step bench_swap_kernel 360 python3 -m kvmgr.cli bench swap-kernel --json "$OUT/swap_kernel.json" ;;
    sim)
      TAIL=10 step pytest_sim 240 python3 -m pytest -q -rf -p no:cacheprovider -m gpu tests/sim/test_sim.py
      TAIL=30 step sim_auto 200 python3 -m kvmgr.cli simulate --engine auto --limit 3000 --quiet --json "$OUT/sim_auto.json" ;;
    engine)  # examples/engine: GPU equality test, then end to end recompute vs auto vs cuda (< 5 min)
      TAIL=8 step pytest_engine 60 python3 -m pytest -q -rf -p no:cacheprovider tests/examples/test_example_engine.py
      TAIL=25 step engine_bench 240 python3 -m examples.engine.bench --json "$OUT/engine.json" ;;
    info)
      step info 60 python3 -m kvmgr.cli info ;;
    docs)  # the doc blocks marked "needs a CUDA GPU" run here; bench's GPU check passes
      TAIL=20 step docs_snippets 180 python3 -m pytest -q -rs -p no:cacheprovider tests/test_docs_snippets.py tests/test_cli.py ;;
    *) echo "unknown section $section" ;;
  esac
done
