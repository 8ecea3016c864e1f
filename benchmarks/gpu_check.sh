#!/usr/bin/env bash
# The GPU check, end to end, on a lent GPU machine (the `device` tool).
#
# The device image has python3 3.12 with torch, numpy, meson, ninja, cython and
# pytest, but not meson-python, msgspec, structlog or pytest-asyncio, and
# nothing can be fetched there. So, first, here (a machine with a registry):
#
#     bash benchmarks/gpu_check.sh fetch      # wheels into .whl/ (git-ignored)
#
# then one device call, from the repository root (about 3-4 minutes of device
# time: install ~1 min, native + pytest GPU tests ~30 s, gpu_check.py ~1 min):
#
#     run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
# What comes back: the output tail (the last line is "GPU_CHECK {json}") and
# $OUT/gpu_check.log with everything.
set -u -o pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = fetch ]; then
    exclude="$(git rev-parse --git-path info/exclude)"  # also right in a git worktree
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl \
        msgspec structlog meson meson-python pyproject-metadata pytest-asyncio
fi

OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1
REPO="$PWD"
{
    echo "== machine"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, torch.cuda.is_available())' || true

    echo "== install"
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site
    fi
    python3 -m pip install -q --no-index --no-deps --no-build-isolation . || exit 1

    echo "== native CUDA tests (absent driver, real driver, software driver)"
    if meson setup /tmp/axf-native -Dpython_ext=false >/dev/null && ninja -C /tmp/axf-native >/dev/null; then
        meson test -C /tmp/axf-native cuda cuda_driver cuda_fake --print-errorlogs || echo "NATIVE CUDA TESTS FAILED"
        /tmp/axf-native/native/tests/test_cuda --driver || true
    else
        echo "native build failed"
    fi

    echo "== pytest -m gpu (outside the checkout: the installed package)"
    (cd /tmp && timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu "$REPO/tests/test_cuda.py") \
        || echo "GPU PYTESTS FAILED"

    echo "== gpu_check.py"
    (cd /tmp && timeout 240 python3 "$REPO/benchmarks/gpu_check.py" --size-mib 256 --iters 5)
} 2>&1 | tee "$LOG"
