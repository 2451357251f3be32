#!/usr/bin/env bash
# Issue 27's kernel launch host cost on the H200 (helper launchhost), from the repo root, no network:
#   bash scripts/gpu/launchhost.sh      # <= ~150 s; results under $OUT/launchhost/ (log + JSON)
# 0. env, and whether the C driver call (kvmgr.kernels.launch.native) builds on this machine:
#    "native fire: <built-in function fire>" (None = packed launches stay on ctypes).
# 1. the GPU tests of the touched files (-m gpu): all must pass.
# 2. `kvmgr bench c128 --batch 1`, twice: the C driver call (default) and KVMGR_NATIVE_LAUNCH=0
#    (ctypes, the old call). Look at the host breakdown: "hook step, gated, packed" (target
#    <= 10 us; round 4: 14.8) and "launch: state write, packed" (round 4: 10.0); native vs ctypes
#    is the driver call's share.
# 3. `kvmgr bench peer --halves mla`: eager and host kvmgr vs the C++ op per row (goal: ratio >= 1
#    in every row; round 4: 9 of 10, host kvmgr 9.7-12.5 us).
# 4. scripts/gpu/launch_probe.py: one tiny kernel's launch, host us per call: PackedLaunch.launch,
#    the C call alone, cuLaunchKernelEx and cuLaunchKernel through ctypes (the driver's own share).
#    `kvmgr bench launch-host`: the Python around a stub driver on this host's CPU (round 4 there:
#    c128 gated 8.5 us, MLA hook 5.7, grouped 16 sets 11.8 at T = 64).
# 5. `kvmgr bench mla-insert --modes eager`: the host columns (grouped, hook: target <= 10 us;
#    round 4: grouped 20.0-22.5, hook 11.7-13.6).
source "${BASH_SOURCE%/*}/_common.sh" launchhost
step env 15 python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name()); from kvmgr.kernels.launch.native import native_fire; print('native fire:', native_fire())"
step tests 35 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/kernels/test_launch.py \
  tests/kernels/test_c128.py tests/kernels/test_mla_insert.py tests/models/test_dsv4_state.py
C128="--batch 1 --prefill 1 --repeats 7 --steps 100 --warmup 2"
step c128_native 18 python3 -m kvmgr.cli bench c128 $C128 --json "$D/c128_native.json"
step c128_ctypes 12 env KVMGR_NATIVE_LAUNCH=0 python3 -m kvmgr.cli bench c128 $C128 --json "$D/c128_ctypes.json"
step peer_mla 35 python3 -m kvmgr.cli bench peer --halves mla --mla-tokens 1,16,128,512 \
  --mla-repeats 5 --mla-json "$D/peer_mla.json"
step probe 12 python3 scripts/gpu/launch_probe.py
step launch_host 8 python3 -m kvmgr.cli bench launch-host --tokens 64 --rounds 30 --json "$D/launch_host.json"
step mla_insert 15 python3 -m kvmgr.cli bench mla-insert --tokens 1,16,128,512 --modes eager \
  --kv-cache-dtypes fp8_e4m3 --reps 10 --json "$D/mla_insert.json"
grep -E "^=== |hook step|launch: state write|gate:|native fire|per call" "$LOG"
tail -n 60 "$LOG"
