#!/usr/bin/env bash
# Issue 27 (helper mlaloop2) on the H200, from the repo root, no network; limits add up to 149 s
# (usually ~100 s):
#   bash scripts/gpu/mlaloop2.sh         # results under $OUT/mlaloop2/ (log.txt + JSON)
# 0. env: versions.
# 1. tests: the MLA insert's and the c128 kernels' GPU tests, the steady-loop tests (a bad step
#    tensor, also one on the CPU, or an out-of-range slot after a steady loop is refused with
#    its typed error) on CUDA, and checked_data_ptrs: all must pass.
# 2. launch_host_ab: `kvmgr bench launch-host --tokens 1,16,128 --rounds 15` for the tree at the
#    branch point ($MLALOOP2_BASE, default 373f872, main when mlaloop2 began) and this one, each
#    from its own root (PYTHONPATH = that root), old then new: min and median per row, ratios.
# 3. launch_host_pair: the same rows, both trees in ONE process, interleaved sample by sample
#    (scripts/launch_host_pair.py): the ratio that survives this host's changes of speed.
#    Targets (this host's CPU, stub driver): "one cache set, new step tensors", "MLA hook, new
#    step tensors", "c128 hook, gated, new step tensors" <= 10 us per call (add the driver's
#    share, 5.6-7.1 us per launch, for the H200's eager figure).
# 4. peer_build, then peer_mla1 / peer_mla2: `bench peer --halves mla` twice (FP8, T = 1,16,128):
#    kvmgr's hook eager / host / graph against the C++ op, bytes equal in every row.
# 5. probe: scripts/gpu/mlaloop2_probe.py (why the hook read 20-24 us at T = 128 in `bench peer`
#    against 9 us at T = 1 / 16): per T the loop host / device time, one call's host time with
#    the queue drained, and one kernel's device time, for the same and new step tensors and for
#    Triton's own launch. Flat call_host with growing kernel / loop_dev: the device; growing
#    call_host: the host path.
source "${BASH_SOURCE%/*}/_common.sh" mlaloop2
BASE=${MLALOOP2_BASE:-373f872d1953fa53c92396e3dea6eb6d9f836432}
D=$(cd "$D" && pwd)
OLD=/tmp/mlaloop2_old  # outside $OUT: nothing of it comes back
rm -rf "$OLD" && mkdir -p "$OLD" && git archive "$BASE" kvmgr | tar -x -C "$OLD"
step env 5 python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name())"
step tests 40 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_mla_insert.py \
  tests/kernels/test_c128.py tests/kernels/test_launch.py -k "gpu or steady or checked or turned_off"
step launch_host_ab 20 python3 scripts/launch_host_ab.py "$OLD" --runs 1 \
  --bench "--tokens 1,16,128 --rounds 15" --json "$D/launch_host_ab.json"
step launch_host_pair 12 python3 scripts/launch_host_pair.py "$OLD" --tokens 1,16,128 \
  --rounds 20 --json "$D/launch_host_pair.json"
step peer_build 30 python3 -c "
import time
from kvmgr.bench._peer_mla_op import build_op, missing_tools
print('missing tools:', missing_tools())
start = time.perf_counter()
build_op(verbose=False)
print(f'peer op built in {time.perf_counter() - start:.1f} s')"
rm -f "$HOME"/.cache/kvmgr/peer_mla-sm*/lock  # a build killed at its limit leaves its lock
for run in 1 2; do
  step "peer_mla$run" 15 python3 -m kvmgr.cli bench peer --halves mla --mla-tokens 1,16,128 \
    --mla-kv-cache-dtypes fp8_e4m3 --mla-repeats 5 --mla-json "$D/peer_mla$run.json"
done
step probe 12 python3 scripts/gpu/mlaloop2_probe.py --tokens 1,16,128,512 --json "$D/probe.json"
grep -E "^=== |passed|failed|error|built in" "$LOG" | tail -n 24
sed -n '/=== launch_host_ab (/,/=== launch_host_ab rc/p; /=== launch_host_pair (/,/=== launch_host_pair rc/p; /=== probe (/,/=== probe rc/p' "$LOG"
python3 - "$D" <<'PY'
import json, os, sys
d = sys.argv[1]
for run in (1, 2):
    path = os.path.join(d, f"peer_mla{run}.json")
    if not os.path.exists(path):
        continue
    print(f"peer run {run} (us)       kvmgr     C++  C++/kvmgr")
    for r in json.load(open(path))["rows"]:
        for kind in ("eager", "host", "graph"):
            ours, theirs = r[f"kvmgr_{kind}_us"], r[f"baseline_{kind}_us"]
            print(f"T={r['tokens']:<5d} {kind:6s} bytes={'yes' if r['bytes_equal'] else 'NO':3s} {ours:7.2f} {theirs:7.2f} {theirs / ours:9.2f}")
PY
