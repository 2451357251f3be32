#!/usr/bin/env bash
# Consolidated GPU calls of the 2026-12-01 session. Usage: bash scripts/gpu_round2.sh a|b
# a: the whole test suite, host path, swap / swap-kernel / MLA / c128 benches
# b: the whole suite without -x, and the peer baselines (MLA + swap)
# c: the end-to-end serving-loop bench (examples/engine)
# One combined log ($OUT/log.txt) plus JSON files, so everything fits the files that come back.
source scripts/gpu/_session.sh  # OUT, the wheels, LOG, run(), the env step
case ${1:-a} in
  a)
    TAIL=25 run pytest_all 270 python3 -m pytest -q -rf -p no:cacheprovider --timeout 120 -x tests
    TAIL=22 run bench_host 80 python3 -m kvmgr.cli bench host --rounds 150 --steps 2000 --json "$OUT/host.json"
    TAIL=30 run bench_swap 75 python3 -m kvmgr.cli bench swap --geometries qwen llama --blocks 512 --repeats 5 --warmup 1 --variants batch_ctypes kernel auto --json "$OUT/swap.json"
    TAIL=30 run bench_swap_kernel 60 python3 -m kvmgr.cli bench swap-kernel --geometries qwen --blocks 512 --repeats 5 --warmup 1 --programs 8 16 32 --matmuls 10 --interference-repeats 3 --json "$OUT/swap_kernel.json"
    TAIL=30 run bench_mla 45 python3 -m kvmgr.cli bench mla-insert --tokens 1,16,128,512,16384 --reps 15 --json "$OUT/mla.json"
    TAIL=30 run bench_c128 35 python3 -m kvmgr.cli bench c128 --repeats 7 --steps 100 --json "$OUT/c128.json" ;;
  b)
    TAIL=25 run pytest_all 230 python3 -m pytest -q -rf -p no:cacheprovider --timeout 120 tests
    TAIL=40 run bench_peer 220 python3 -m kvmgr.cli bench peer --mla-json "$OUT/peer_mla.json" --swap-repeats 8 --swap-json "$OUT/peer_swap.json"
    ;;
  c)
    TAIL=25 run pytest_rest 140 python3 -m pytest -q -rf -p no:cacheprovider --timeout 60 tests/kernels/test_mla_insert.py tests/manager/test_reliability.py tests/sim/test_sim.py tests/manager/test_manager_v2.py tests/manager/test_manager_stateful.py tests/testing/test_testing_kit.py tests/policy/test_policy.py
    TAIL=30 run engine_bench 380 python3 -m examples.engine.bench --json "$OUT/engine.json" ;;
esac
