#!/usr/bin/env bash
# The GPU calls of round 4 (2026-12-02). Usage (on the H200, repo root):
#   bash scripts/gpu_round4.sh merged1   # the whole GPU suite, launch-stack benches, step table
#   bash scripts/gpu_round4.sh tests     # the whole GPU suite alone
#   bash scripts/gpu_round4.sh merged2   # the C++ peer, pinned tier, DeepSeek-V4 state, host path
#   bash scripts/gpu_round4.sh suite NAME...  # the suite over 4 workers, then the NAME sections
#   bash scripts/gpu_round4.sh NAME...   # the sections scripts/gpu/NAME.sh of this round's work
# One combined log ($OUT/log.txt) plus JSON files (at most 8 files come back: keep it so).
source scripts/gpu/_session.sh  # OUT, the wheels, LOG, run(), the env step
what=${1:-merged1}
J="$OUT/r4.jsonl"  # every bench's JSON, one object per line: {"bench": name, "result": ...}
keep() { local name=$1 file=$2; [ -f "$file" ] && python3 -c "import json,sys; print(json.dumps({'bench': sys.argv[1], 'result': json.load(open(sys.argv[2]))}))" "$name" "$file" >>"$J"; }
if [ "$what" = merged1 ] || [ "$what" = tests ]; then
  TAIL=8 run pytest_all 280 python3 -m pytest -q -rfs -p no:cacheprovider --timeout 120 tests
fi
if [ "$what" = suite ]; then  # the whole suite over 4 workers (pytest-xdist is on the image)
  TAIL=25 run pytest_suite "${SUITE_SECS:-240}" python3 -m pytest -q -rfE -p no:cacheprovider -p no:benchmark --timeout 120 -n "${SUITE_WORKERS:-4}" tests
  shift
fi
if [ "$what" = merged1 ]; then
  TAIL=30 run bench_launch_host 60 python3 -m kvmgr.cli bench launch-host --json /tmp/lh.json; keep launch-host /tmp/lh.json
  TAIL=22 run bench_mla 60 python3 -m kvmgr.cli bench mla-insert --tokens 1,16,128,512,16384 --reps 15 --json /tmp/mla.json; keep mla-insert /tmp/mla.json
  TAIL=20 run bench_c128 60 python3 -m kvmgr.cli bench c128 --batch 1 128 --repeats 7 --steps 100 --json /tmp/c128.json; keep c128 /tmp/c128.json
  TAIL=30 run bench_swap 90 python3 -m kvmgr.cli bench swap --geometries qwen llama --blocks 512 --repeats 7 --warmup 2 --json /tmp/swap.json; keep swap /tmp/swap.json
fi
if [ "$what" = merged2 ]; then
  TAIL=18 run bench_peer_mla 150 python3 -m kvmgr.cli bench peer --halves mla --mla-json /tmp/peer_mla.json; keep peer-mla /tmp/peer_mla.json
  TAIL=20 run bench_pin16 90 python3 -m kvmgr.cli bench pin --gib 16 --threads 8 --json /tmp/pin16.json; keep pin16 /tmp/pin16.json
  TAIL=20 run bench_pin48 150 python3 -m kvmgr.cli bench pin --gib 48 --threads 8 --variants pieces,round3 --json /tmp/pin48.json; keep pin48 /tmp/pin48.json
  TAIL=20 run bench_dsv4 90 python3 -m kvmgr.cli bench dsv4 --boundaries 1001 4163 32701 --repeats 5 --json /tmp/dsv4.json; keep dsv4 /tmp/dsv4.json
  TAIL=12 run bench_host 90 python3 -m kvmgr.cli bench host --json /tmp/host.json; keep host /tmp/host.json
fi
case $what in merged1|merged2|tests) ;; *)
  for name in "$@"; do
    f=scripts/gpu/$name.sh; [ -f "$f" ] || { echo "no $f"; continue; }
    mkdir -p "$OUT/$name"
    TAIL=25 run "gpu_$name" "${GPU_SECS:-330}" env OUT="$OUT/$name" bash "$f"
  done ;;
esac
# at most 8 files come back: the sections' folders travel as one archive
dirs=$(cd "$OUT" && find . -mindepth 1 -maxdepth 1 -type d -printf '%P\n')
[ -n "$dirs" ] && (cd "$OUT" && tar czf sections.tgz $dirs && rm -rf $dirs)
echo "=== done ($(date -u +%T))"
