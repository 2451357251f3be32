#!/usr/bin/env bash
# Diagnostic: the staged H2D chunked AcceleratorError (session 3).
set -u
T="tests/test_staged_gpu.py::test_staged_bytes_on_the_gpu"
echo "--- merged main, each case alone"
for c in "1000-Direction.D2H" "1000-Direction.H2D" "7-Direction.D2H" "7-Direction.H2D"; do
  timeout 40 python3 -m pytest -q -x -p no:cacheprovider -p no:randomly "$T[$c]" 2>&1 | tail -1
done
timeout 40 python3 -m pytest -q -x -p no:cacheprovider -p no:randomly "tests/test_staged_gpu.py::test_auto_stages_a_step_of_consecutive_cpu_blocks" 2>&1 | tail -1
echo "--- staged branch (before the stepplan merge), 7-H2D"
(cd _staged_tree && PYTHONPATH="$PWD:/tmp/site" timeout 40 python3 -m pytest -q -x -p no:cacheprovider -p no:randomly "$T[7-Direction.H2D]" 2>&1 | tail -1)
echo "--- CUDA_LAUNCH_BLOCKING=1, 7-H2D"
CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 -m pytest -q -x -p no:cacheprovider -p no:randomly "$T[7-Direction.H2D]" 2>&1 | grep -E "Error|error|staged|kernel|\.py:[0-9]+" | head -30
echo "--- compute-sanitizer, 7-H2D"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
echo "sanitizer: $CS"
[ -n "$CS" ] && timeout 120 "$CS" --tool memcheck --print-limit 5 python3 -m pytest -q -x -p no:cacheprovider -p no:randomly "$T[7-Direction.H2D]" 2>&1 | grep -vE "^\s*$" | head -60
