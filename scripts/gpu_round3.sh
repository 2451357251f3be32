#!/usr/bin/env bash
# The GPU call of the third session (2026-12-01): the whole test suite, then the issue-12 benches
# (step table, swap-kernel interference, MLA insert, c128, the C++ peers) and the submit-path
# profile. Usage: bash scripts/gpu_round3.sh [tests|bench|all|kernels|launch]: "kernels" is call 4
# of BENCHMARKS.md round 3 (the copy/engine/manager GPU tests, step table, peer swaps), "launch"
# call 5 (copy-kernel programs and interference, MLA insert, peer MLA, c128). One combined log
# ($OUT/log.txt) plus JSON files, so everything fits the files that come back.
source scripts/gpu/_session.sh  # OUT, the wheels, LOG, run(), the env step
what=${1:-all}
if [ "$what" = kernels ]; then
  TAIL=4 run pytest_kernels 200 python3 -m pytest -q -rf -p no:cacheprovider --timeout 120 tests/kernels/test_copy_blocks.py tests/kernels/test_copy_kernel.py tests/transfer/test_cuda_engine.py tests/manager/test_manager_engines.py tests/kernels/test_mla_insert.py tests/sim/test_sim.py tests/manager/test_reliability.py tests/examples/test_example_engine.py
  TAIL=32 run bench_swap 60 python3 -m kvmgr.cli bench swap --geometries qwen llama --blocks 512 --repeats 7 --warmup 2 --variants kernel kernel_desc auto --json "$OUT/swap.json"
  TAIL=14 run bench_peer_swap 150 python3 -m kvmgr.cli bench peer --halves swap --swap-repeats 8 --swap-json "$OUT/peer_swap.json"
  exit 0
fi
if [ "$what" = launch ]; then
  TAIL=20 run bench_swap_kernel 60 python3 -m kvmgr.cli bench swap-kernel --geometries qwen --blocks 512 --repeats 5 --warmup 1 --programs 8 12 16 32 --matmuls 10 --interference-repeats 3 --json "$OUT/swap_kernel.json"
  TAIL=22 run bench_mla 50 python3 -m kvmgr.cli bench mla-insert --tokens 1,16,128,512,16384 --reps 15 --json "$OUT/mla.json"
  TAIL=16 run bench_peer_mla 150 python3 -m kvmgr.cli bench peer --halves mla --mla-json "$OUT/peer_mla.json"
  TAIL=20 run bench_c128 60 python3 -m kvmgr.cli bench c128 --repeats 7 --steps 100 --json "$OUT/c128.json"
  exit 0
fi
if [ "$what" != bench ]; then
  TAIL=6 run pytest_all 240 python3 -m pytest -q -rfs -p no:cacheprovider --timeout 120 tests
fi
if [ "$what" != tests ]; then
  TAIL=14 run bench_swap 60 python3 -m kvmgr.cli bench swap --geometries qwen --blocks 512 --repeats 7 --warmup 2 --variants kernel kernel_desc auto --json "$OUT/swap.json"
  TAIL=12 run bench_swap_kernel 45 python3 -m kvmgr.cli bench swap-kernel --geometries qwen --blocks 512 --repeats 5 --warmup 1 --programs 8 32 --matmuls 10 --interference-repeats 3 --json "$OUT/swap_kernel.json"
  TAIL=14 run bench_peer 170 python3 -m kvmgr.cli bench peer --mla-json "$OUT/peer_mla.json" --swap-repeats 8 --swap-json "$OUT/peer_swap.json"
  TAIL=22 run bench_mla 40 python3 -m kvmgr.cli bench mla-insert --tokens 1,16,128,512,16384 --reps 15 --json "$OUT/mla.json"
  TAIL=20 run bench_c128 45 python3 -m kvmgr.cli bench c128 --repeats 7 --steps 100 --json "$OUT/c128.json"
  TAIL=3 run profile 60 python3 scripts/gpu_profile.py micro dma step
fi
