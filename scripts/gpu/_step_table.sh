# `kvmgr bench swap`'s step table (512 queued one-block stores of 48 x 4 KiB pages; cuda engine
# on consecutive ids, kernel engine on scattered ones) for an old tree and this checkout
# alternately, each from its own root, sourced after _common.sh:
#   step_table_ab BASE SKIP_AFTER_S
# BASE: the old revision (extracted with git archive; its rows are skipped without history);
# the second round runs only if under SKIP_AFTER_S seconds have passed. Writes
# $D/step_{old,new}_{1,2}.json (limits 30 s a run in the first round, 20 s in the second). Each
# tree runs with PYTHONPATH set to its root only (after the wheels' site): `python3 -m` from this checkout would put the
# new kvmgr first on sys.path for the old tree too.
step_table_ab() {
  local base=$1 skip_after=$2 new="$PWD" old="" run tree root
  local args="--geometries qwen --blocks 64 --variants none --repeats 10 --warmup 3 --step-swaps 512 --step-engines cuda kernel"
  if [ -n "$base" ]; then
    old="$(mktemp -d)"
    base_tree "$base" "$old" || old=""
  fi
  [ -z "$old" ] && echo "no git history: the old tree's rows are skipped" | tee -a "$LOG"
  for run in 1 2; do
    [ "$run" = 2 ] && [ "$SECONDS" -gt "$skip_after" ] && { echo "second round skipped (time)" | tee -a "$LOG"; break; }
    for tree in old new; do
      root="$new"; [ "$tree" = old ] && root="$old"
      [ -z "$root" ] && continue
      step "step_${tree}_$run" $((run == 1 ? 30 : 20)) bash -c "cd '$root' && PYTHONPATH='$SITE_PATH$root' python3 -m kvmgr.cli bench swap \
        $args --json '$D/step_${tree}_$run.json'"
    done
  done
  [ -n "$old" ] && rm -rf "$old"
  return 0
}
# branch_base NAME POINT: main just before branch NAME was first merged into it (the first parent
# of "Merge branch 'NAME'"), else the branch point POINT, else `git merge-base HEAD main`; a
# revision the checkout lacks is kept where build/bases/REV/kvmgr was carried (base_tree).
branch_base() {
  local first base
  first=$(git log --merges --reverse --format=%H --grep="^Merge branch '$1'" 2>/dev/null | head -1)
  base=${first:+$first^1}
  [ -z "$base" ] && base=$2
  git rev-parse --verify -q "$base^{commit}" >/dev/null 2>&1 || [ -d "build/bases/$base/kvmgr" ] \
    || base=$(git merge-base HEAD main 2>/dev/null)
  echo "$base"
}
# device_read_step: step "device_read" (15 s), best of 5 x 20000 calls each:
# torch.cuda.current_device() against kvmgr's device_is_current and on_device.
device_read_step() {
  step device_read 15 python3 -c "
import timeit, torch
from kvmgr.transfer.cuda_current import device_is_current, on_device
dev = torch.device('cuda', torch.cuda.current_device())
torch.cuda.Stream(dev)  # CUDA initialized, as an engine finds it
for name, fn in (('torch.cuda.current_device()', torch.cuda.current_device),
                 ('device_is_current', lambda: device_is_current(dev)),
                 ('on_device', lambda: on_device(dev))) * 2:
    best = min(timeit.repeat(fn, number=20000, repeat=5)) / 20000 * 1e6
    print(f'device read {name}: {best:.3f} us')
assert device_is_current(dev)
"
}
# env_step SECONDS: step "env": the versions (python, torch, the GPU) and whether the C call
# module builds here.
env_step() {
  step env "$1" python3 -c "import sys, torch; from kvmgr.transfer.driver_call import native_call; \
print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(), 'C call:', native_call())"
}
