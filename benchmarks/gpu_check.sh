#!/usr/bin/env bash
# The GPU check, end to end, on a lent GPU machine (the `device` tool).
#
# The device image has python3 3.12 with torch, numpy, meson, ninja, cython and
# pytest, but not meson-python, msgspec, structlog or pytest-asyncio, and
# nothing can be fetched there. So, first, here (a machine with a registry):
#
#     bash benchmarks/gpu_check.sh fetch      # wheels into .whl/ and .whl-nixl/ (git-ignored)
#
# then one device call, from the repository root (about 5-6 minutes of device
# time: install ~1 min, native build and tests ~40 s, gpu_nixl.py ~1 min (first
# after those: the figures a session is for), pytest GPU tests ~30 s,
# gpu_check.py ~1-2 min, gpu_bench.py ~30 s, with a NIC ~30 s more; every
# step has a timeout). The two last lines: GPU_FIGURES (aioxfer.nixl / NIXL
# at WRITE 4 KiB-1 MiB, csw/op) and GPU_CHECK (every step):
#
#     run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".whl-nixl"], timeout_s=480)
#
# The steps follow the bring-up order (each one is what the next relies on):
# driver symbols and attributes; context hygiene; IPC at an odd 512-byte
# offset; bandwidth GPU <-> local host, GPU <-> a peer's memfd, GPU <-> GPU;
# then, with a NIC: GID tables, a perftest baseline, the verbs suite on the
# real libibverbs (with a GPU WRITE of 100 bytes). What comes back: the output
# tail, whose last line is one JSON object ("GPU_CHECK {...}": every step's
# status and gpu_check.py's figures), and $OUT/gpu_check.log with everything.
set -u -o pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = fetch ]; then
    exclude="$(git rev-parse --git-path info/exclude)"  # also right in a git worktree
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    grep -qx '/.whl-nixl/' "$exclude" 2>/dev/null || echo '/.whl-nixl/' >> "$exclude"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl \
        msgspec structlog meson meson-python pyproject-metadata pytest-asyncio pytest pluggy || exit 1
    # Real NIXL for step 9 (gpu_nixl.py), in its own folder, for CUDA 13 (the
    # device image's torch is built for it, and NIXL picks its wheel by that): its wheel is ~69 MB,
    # over the 64 MiB a device call carries, and 37 MB of it is nixl_ep (expert
    # parallelism kernels, unused here), so the copy carried leaves nixl_ep out.
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 -d .whl-nixl nixl==1.5.1 nixl-cu13==1.5.1 || exit 1
    exec python3 - .whl-nixl/nixl_cu13-*.whl <<'PY'
import sys, zipfile, os
src = sys.argv[1]
tmp = src + ".tmp"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if item.filename.startswith("nixl_ep"):
            continue
        data = zin.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if not l.startswith(b"nixl_ep"))
        zout.writestr(item, data)
os.replace(tmp, src)
print(f"{src}: {os.path.getsize(src) >> 20} MiB without nixl_ep")
PY
fi

OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1
REPO="$PWD"
T0=$SECONDS
# Step results for the one JSON line at the end: name=status pairs.
STEPS="$OUT/steps.txt"
: > "$STEPS"
step() { echo "$1=$2" >> "$STEPS"; }
{
    # The bring-up order: what must work before the next step means anything.
    echo "== 0. machine"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,pci.bus_id --format=csv,noheader || true
    nvidia-smi topo -m 2>/dev/null | head -20 || true
    python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, torch.cuda.is_available(), torch.cuda.device_count())' || true
    # an empty /sys/class/infiniband (seen on the H200 machine) is no NIC
    [ -n "$(ls -A /sys/class/infiniband 2>/dev/null)" ] && NIC=1 || NIC=0
    echo "RDMA devices: $NIC; RLIMIT_MEMLOCK $(ulimit -l); nvidia_peermem $([ -d /sys/module/nvidia_peermem ] && echo loaded || echo absent)"

    echo "== install"
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site
    fi
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -Ccompile-args=-j"$(nproc)" . && step install ok || { step install FAILED; exit 1; }
    (cd /tmp && python3 -m aioxfer info) || true

    echo "== 1-2. driver symbols and attributes, context hygiene, IPC, VMM/managed (native, real driver)"
    if meson setup /tmp/axf-native -Dpython_ext=false >/dev/null && ninja -C /tmp/axf-native >/dev/null; then
        if timeout 90 /tmp/axf-native/native/tests/test_cuda --driver; then step native_cuda ok; else step native_cuda FAILED; fi
        # the software stand-ins on the same machine: their rules, next to the real ones
        # (those defined: verbs_abi only where rdma-core's header is; meson test
        # refuses the whole list over one unknown name)
        defined=$(meson test -C /tmp/axf-native --list 2>/dev/null | sed 's/.*://')
        standins=$(for t in cuda_fake verbs softverbs verbs_abi; do
                       grep -qx "$t" <<< "$defined" && echo "$t"; done)
        # shellcheck disable=SC2086  # one name per word
        timeout 240 meson test -C /tmp/axf-native $standins --print-errorlogs \
            > "$OUT/standins.log" 2>&1 && step native_standins ok || step native_standins FAILED
        grep -E "^ *[0-9]+/[0-9]+ |check failed|FAIL" "$OUT/standins.log" | head -20
    else
        step native_build FAILED
    fi

    echo "== 9. gpu_nixl.py: GPU -> peer GPU through NIXL's API, real NIXL beside aioxfer.nixl"
    # first after the native checks: its WRITE 4 KiB-1 MiB ratios and csw/op are
    # what a session is for, so no later step's timeout can crowd them out
    if ls .whl-nixl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/nixlsite .whl-nixl/*.whl \
        && (cd /tmp && PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/nixlsite" NIXL_LOG_LEVEL=WARN \
            timeout 150 python3 "$REPO/benchmarks/gpu_nixl.py" --secs 0.3 --json "$OUT/gpu_nixl.json" \
            | grep -v '^20..-..-..T') && step gpu_nixl ok || step gpu_nixl FAILED
    else
        step gpu_nixl "not fetched"
    fi

    echo "== 3. pytest -m gpu (the installed package)"
    (cd /tmp && timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$REPO/tests/test_cuda.py" \
        "$REPO/tests/test_nixl_cuda.py") && step pytest_gpu ok || step pytest_gpu FAILED

    echo "== 1-7. gpu_check.py: driver, hygiene, odd-offset IPC, bandwidth GPU<->host / peer memfd / GPU, file, peer kill, NIC"
    (cd /tmp && timeout 170 python3 "$REPO/benchmarks/gpu_check.py" --size-mib 256 --iters 5 \
        --json "$OUT/gpu_check.json") && step gpu_check ok || step gpu_check FAILED

    echo "== 8. gpu_bench.py: 4 KiB ... 256 MiB one request at a time (GB/s, p50), host memory over cuda vs shm, limits"
    (cd /tmp && timeout 90 python3 "$REPO/benchmarks/gpu_bench.py" --secs 0.3 --json "$OUT/gpu_bench.json" \
        | grep -v '^20..-..-..T') && step gpu_bench ok || step gpu_bench FAILED

    if [ "$NIC" = 1 ]; then
        echo "== 7. NIC: GID tables, perftest baseline, the verbs suite on the real libibverbs"
        for d in /sys/class/infiniband/*; do
            for p in "$d"/ports/*; do
                for g in "$p"/gids/*; do
                    v=$(cat "$g" 2>/dev/null); t=$(cat "$p/gid_attrs/types/$(basename "$g")" 2>/dev/null)
                    [ -n "$v" ] && [ "$v" != "0000:0000:0000:0000:0000:0000:0000:0000" ] \
                        && echo "$(basename "$d") port $(basename "$p") gid[$(basename "$g")] $v $t"
                done
            done
        done
        dev=$(ls /sys/class/infiniband | head -1)
        if command -v ib_write_bw >/dev/null; then
            (timeout 20 ib_write_bw -d "$dev" -s 1048576 -D 3 >/tmp/perf_srv.txt 2>&1 &)
            sleep 1
            timeout 20 ib_write_bw -d "$dev" -s 1048576 -D 3 localhost > "$OUT/perftest.txt" 2>&1 \
                && step perftest ok || step perftest FAILED
            tail -3 "$OUT/perftest.txt"
        else
            step perftest "not installed"
        fi
        # the transport's own suite, both engines in one process over the NIC;
        # includes a GPU WRITE of 100 bytes (below the inline limit) through dmabuf
        AXF_VERBS_REAL=1 timeout 90 /tmp/axf-native/native/tests/test_verbs \
            && step verbs_real ok || step verbs_real FAILED
    else
        step nic "none"
    fi
    echo "== done in $((SECONDS - T0)) s"
} 2>&1 | tee "$LOG"

# Two JSON lines: the figures asked of a GPU session (GPU_FIGURES: aioxfer.nixl
# over NIXL at WRITE 4 KiB-1 MiB GPU -> peer GPU, and context switches per
# request of each, from gpu_nixl.py; aioxfer's own API from gpu_bench.py), then
# every step's status, gpu_check.py's figures and the time taken (GPU_CHECK).
python3 - "$STEPS" "$OUT" "$((SECONDS - T0))" <<'PY'
import json, sys
steps = dict(line.strip().split("=", 1) for line in open(sys.argv[1]) if "=" in line)
def load(name):
    try:
        return json.load(open(f"{sys.argv[2]}/{name}"))
    except (OSError, ValueError):
        return None
detail, nixl, bench = load("gpu_check.json"), load("gpu_nixl.json"), load("gpu_bench.json")
small = ("4096", "65536", "1048576")
figures = {}
if nixl:
    figures["nixl_write_ratio"] = {n: nixl["ratio_aioxfer_nixl_over_nixl"].get(f"WRITE {n}")
                                   for n in small}
    figures["nixl_write_csw_per_op"] = nixl.get("csw_per_op")
    figures["nixl_failed"] = nixl.get("failed")
    figures["nixl_verified"] = nixl.get("all_verified")
if bench and isinstance(bench.get("rows"), dict):
    figures["aioxfer_write_gpu_fargpu"] = {
        n: {k: round(r[k], 2) for k in ("p50_us", "csw") if k in r}
        for n in small if (r := bench["rows"].get(f"WRITE GPU->farGPU {n}"))}
print("GPU_FIGURES " + json.dumps(figures, sort_keys=True))
ok = all(v in ("ok", "none", "not installed", "not fetched") for v in steps.values()) and bool(detail and detail.get("ok"))
print("GPU_CHECK " + json.dumps({"ok": ok, "seconds": int(sys.argv[3]), "steps": steps,
                                 "figures": figures, "gpu_check": detail}, sort_keys=True))
PY
