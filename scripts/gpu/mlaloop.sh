#!/usr/bin/env bash
# Issue 27 (helper mlaloop) on the H200, from the repo root, no network; at most ~194 s
# (limits 10 + 40 + 45 + 35 + 4 x 16; a build past 45 s goes on in the peer_mla step):
#   bash scripts/gpu/mlaloop.sh          # results under $OUT/mlaloop/ (log.txt + JSON)
# 0. env: versions, cores, nvcc, ninja.
# 1. tests: the peer op's build tests and the MLA insert's guard, scales and cache-set
#    tests on CUDA (all must pass).
# 2. peer_build: the C++ baseline of `bench peer --halves mla` built alone (ninja, MAX_JOBS = the
#    cores, -O2, one -gencode for this GPU, into ~/.cache/kvmgr/peer_mla-sm90): the log's line
#    "peer op built in N s" is the build time (it ran past a 170-s slot as a load_inline).
# 3. peer_mla: `bench peer --halves mla` (finds the op built): kvmgr eager / host / graph against
#    the C++ op, same process, bytes_equal must be yes in every row.
# 4. mla_insert_{old,new}{1,2}: `bench mla-insert` (eager, FP8, T = 1,16,128) for the tree at
#    the branch point ($MLALOOP_BASE, default 1c18726) and this one, alternately, each from its
#    own root. Target (issue 27): "grouped_same" host (one cache set, new step tensors) and the
#    hook <= 10 us per call.
# The last lines: the peer table as ratios, and the old/new table (min over the two runs).
source "${BASH_SOURCE%/*}/_common.sh" mlaloop
BASE=${MLALOOP_BASE:-1c187269e42cc3ef22ce7084202c7f6c4df94ed3}
D=$(cd "$D" && pwd)
OLD=/tmp/mlaloop_old  # outside $OUT: nothing of it comes back
mkdir -p "$OLD" && git archive "$BASE" kvmgr | tar -x -C "$OLD"
step env 10 bash -c 'python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name())"; nproc; which nvcc ninja c++; nvcc --version | tail -n 2'
step tests 40 python3 -m pytest -q -x -p no:cacheprovider tests/bench/test_peer_mla_op.py \
  tests/kernels/test_mla_insert.py -k "peer or guarded or grad_modes or rotating_scales or repeated_caches or direct_launch_is_exact"
step peer_build 45 python3 -c "
import time
from kvmgr.bench._peer_mla_op import build_op, missing_tools
print('missing tools:', missing_tools())
start = time.perf_counter()
build_op(verbose=True)
print(f'peer op built in {time.perf_counter() - start:.1f} s')"
# a build killed at its limit leaves torch's build lock behind: the next load would wait on it
rm -f "$HOME"/.cache/kvmgr/peer_mla-sm*/lock
step peer_mla 35 python3 -m kvmgr.cli bench peer --halves mla --mla-tokens 1,16,128 \
  --mla-kv-cache-dtypes fp8_e4m3 --mla-repeats 5 --mla-json "$D/peer_mla.json"
MLA="--tokens 1,16,128 --reps 11 --modes eager --kv-cache-dtypes fp8_e4m3"
for run in 1 2; do
  for tree in old new; do
    if [ $tree = old ]; then at=(env -C "$OLD" PYTHONPATH="$OLD"); else at=(env); fi
    step "mla_insert_${tree}$run" 16 "${at[@]}" python3 -m kvmgr.cli bench mla-insert $MLA \
      --json "$D/mla_insert_${tree}$run.json"
  done
done
grep -E "^=== |passed|failed|error|built in" "$LOG" | tail -n 24
python3 - "$D" <<'EOF'
import glob, json, os, sys
d = sys.argv[1]
peer = os.path.join(d, "peer_mla.json")
if os.path.exists(peer):
    print(f"{'peer (us)':24s} {'kvmgr':>7s} {'C++':>7s} {'C++/kvmgr':>9s}")
    for r in json.load(open(peer))["rows"]:
        for kind in ("eager", "host", "graph"):
            ours, theirs = r[f"kvmgr_{kind}_us"], r[f"baseline_{kind}_us"]
            print(f"T={r['tokens']:<5d} {kind:6s} bytes={'yes' if r['bytes_equal'] else 'NO':3s}  {ours:7.2f} {theirs:7.2f} {theirs / ours:9.2f}")
def best(tree):
    out = {}
    for path in glob.glob(os.path.join(d, f"mla_insert_{tree}*.json")):
        for x in json.load(open(path))["rows"]:
            for k, v in x.items():
                if k.endswith("_host_us") and v is not None:
                    name = f"T={x['tokens']} {k[:-8]}"
                    out[name] = min(v, out.get(name, v))
    return out
old, new = best("old"), best("new")
print(f"{'mla-insert eager host, min of medians (us)':44s} {'old':>7s} {'new':>7s} {'new/old':>7s}")
for name, n in new.items():
    o = old.get(name)
    print(f"{name:44s} {o or float('nan'):7.2f} {n:7.2f} {n / o if o else float('nan'):7.2f}")
EOF
