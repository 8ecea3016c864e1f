#!/usr/bin/env bash
# The GPU checks for a machine with a CUDA driver and device (run from the
# repository root; OUT: a folder for the logs, default ./gpu-out). Builds and
# installs aioxfer into /tmp/axf, then, each step bounded so one that hangs
# cannot eat the rest:
#   1. what CUDA the engine sees (aioxfer.cuda.status / device_info);
#   2. the GPU tests of tests/test_cuda.py and the conformance suite, whose
#      "cuda" parameter runs only where a driver is found (real, not fakecuda);
#   3. benchmarks/gpu_bench.py: GPU <-> GPU and host <-> GPU between two
#      processes beside cuMemcpy and PyTorch's copies, verified;
#   4. suites whose same-host default becomes "cuda" when CUDA is present.
# Python packages the machine lacks come from .whl/ (see the device notes).
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
REPO=$PWD
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/axf:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/axf/bin:/tmp/site/bin:$PATH
step() { echo; echo "=== $* ($(date +%T))"; }

step machine
nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total --format=csv
python3 -c 'import sys, numpy; print(sys.version.split()[0], "numpy", numpy.__version__)'
command -v cc gcc ninja meson; python3 -c "import sysconfig, os; i = sysconfig.get_paths()['include']; print(i, os.path.exists(i + '/Python.h'))"

step build
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/axf \
    -Ccompile-args=-j16 "$REPO" 2>&1 | tail -20 || { echo "BUILD FAILED"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"

step cuda status
cd /tmp
python3 - <<'EOF'
import aioxfer
from aioxfer import cuda
print("aioxfer", aioxfer.__file__)
print("status", cuda.status())
for d in cuda.device_info():
    print(" ", d)
EOF

step "gpu tests + conformance over cuda"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfEs \
    -k "not test_gpu_tests_on_the_software_driver" \
    "$REPO/tests/test_cuda.py" "$REPO/tests/test_conformance.py" 2>&1 | tail -40
echo "pytest rc=$?"

step gpu_bench
timeout 120 python3 "$REPO/benchmarks/gpu_bench.py" --secs 0.3 --json "$OUT/gpu_bench.json" 2>&1 \
    | grep -v "^20..-..-..T"
echo "bench rc=$?"

step "suites with cuda as the same-host default"
timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE \
    "$REPO/tests/test_progress.py" "$REPO/tests/test_hardening.py" "$REPO/tests/test_rails.py" \
    "$REPO/tests/test_cli.py" "$REPO/tests/test_examples.py" "$REPO/tests/test_api.py" 2>&1 \
    | grep -E "^(FAILED|ERROR)|passed|failed"
echo "pytest rc=$?"
