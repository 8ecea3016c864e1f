#!/usr/bin/env bash
# A fresh `pip install .` without rdma-core's or liburing's headers builds every
# transport, and what cannot run here says why at run time (issue 10, item 2).
#
# Needs root (a private mount namespace hides /usr/include/infiniband,
# /usr/include/liburing{,.h} and, for the second check, libibverbs itself;
# nothing outside this process tree sees it). Uses the current Python's build
# tools (meson-python, Cython, numpy) and installs the wheel into a throwaway
# venv that pip fills from the configured index.
#
#   sudo tools/check_fresh_build.sh [WORKDIR]
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d /tmp/aioxfer-fresh.XXXXXX)}
mkdir -p "$work"
python=${PYTHON:-python3}

if [ "${AIOXFER_FRESH_INNER:-}" != 1 ]; then
    exec env AIOXFER_FRESH_INNER=1 unshare -m --propagation private "$0" "$work"
fi

hide_dir() { [ -d "$1" ] && mount -t tmpfs tmpfs "$1" || true; }
hide_file() { [ -e "$1" ] && mount --bind /dev/null "$1" || true; }

hide_dir /usr/include/infiniband
hide_dir /usr/include/liburing
hide_file /usr/include/liburing.h
if echo '#include <infiniband/verbs.h>' | cc -E -x c - >/dev/null 2>&1; then
    echo "check_fresh_build: infiniband/verbs.h is still visible" >&2
    exit 1
fi

cd "$root"
"$python" -m pip wheel -q --no-build-isolation --no-deps -w "$work" . \
    -Cbuild-dir="$work/build"
summary=$(grep -E '^\s+(RDMA verbs|io_uring)\s+:' "$work/build/meson-logs/meson-log.txt" | sort -u)
echo "$summary"
grep -q 'RDMA verbs *: built' <<<"$summary" || { echo "verbs not built" >&2; exit 1; }
grep -q 'io_uring *: built' <<<"$summary" || { echo "io_uring not built" >&2; exit 1; }

"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$work"/aioxfer-*.whl
cd "$work"  # not the source tree: the installed package only
"$work/venv/bin/python" - <<'EOF'
import aioxfer._cyx as c
n, _, why = c.verbs_probe()
assert n >= 0 or "not built" not in why, why
print("verbs at run time:", n, why or "ok")
EOF
info=$("$work/venv/bin/aioxfer" info)
echo "$info" | grep -E '^  (verbs|file) '
echo "$info" | grep -qE '^  verbs +(available|unavailable: .+)' || { echo "no verbs line" >&2; exit 1; }

# Without libibverbs at all: still imports, and says why verbs is off.
for lib in /usr/lib/*/libibverbs.so.1 /lib/*/libibverbs.so.1; do
    [ -e "$lib" ] && mount --bind /dev/null "$(readlink -f "$lib")" || true
done
info=$("$work/venv/bin/aioxfer" info)
echo "$info" | grep -E '^  verbs '
echo "$info" | grep -qE '^  verbs +unavailable: cannot load libibverbs' || {
    echo "verbs without libibverbs does not say why" >&2; exit 1; }
echo "check_fresh_build: ok"
