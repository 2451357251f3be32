# The shared start of the whole-session GPU scripts (scripts/gpu_round2.sh .. gpu_round4.sh),
# sourced from the repo root: source scripts/gpu/_session.sh
# Makes $OUT (default ./out); installs the wheels under .whl/ (when there are any) into
# /tmp/site, put on PYTHONPATH before the repo; sets LOG ($OUT/log.txt, the one combined log);
# defines
#   run NAME SECONDS CMD...  run CMD under a time limit into /tmp/NAME.log, append that to $LOG,
#                            print its last ${TAIL:-12} lines between "=== NAME" lines (the
#                            last one with the exit status);
# and runs the first step, `env` (the GPU, driver, Python, torch, CUDA, Triton, numpy).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
LOG="$OUT/log.txt"
run() { local name=$1 secs=$2; shift 2; echo "=== $name ($(date -u +%T))" | tee -a "$LOG"; timeout "$secs" "$@" >"/tmp/$name.log" 2>&1; local rc=$?; cat "/tmp/$name.log" >>"$LOG"; tail -n "${TAIL:-12}" "/tmp/$name.log"; echo "=== $name rc=$rc" | tee -a "$LOG"; }
TAIL=3 run env 30 bash -c 'nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, triton, sys, numpy; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, numpy.__version__)"'
