#!/usr/bin/env bash
# Round 4 session 15, the coordinator's second call: the GPU tests that failed in the merged
# tree's suite (CopyStreams' device check under a fake CUDA, fixed after call 1) with the device
# check's own tests, then `kvmgr bench host` (issue 27's batched-round and per-call rows) of
# this tree and of the base tree cc05b07 (carry build/bases/cc05b07), one after the other.
# Results under $OUT/check15/ (log.txt, host_new.json, host_old.json). About 2.5 minutes.
source "${BASH_SOURCE%/*}/_common.sh" check15
D=$(cd "$D" && pwd)
LOG="$D/log.txt"
step tests 60 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --timeout 60 \
  tests/transfer/test_stream_timing.py tests/transfer/test_layerwise_fake_cuda.py \
  tests/transfer/test_cuda_current.py
step host_new 70 python3 -m kvmgr.cli bench host --json "$D/host_new.json"
base=$(mktemp -d)
if base_tree cc05b07 "$base"; then
  (cd "$base" && PYTHONPATH="$base:${PYTHONPATH:-}" step host_old 70 python3 -m kvmgr.cli bench host --json "$D/host_old.json")
fi
