#!/usr/bin/env bash
# Coverage-guided fuzzing at scale (issue 9): libFuzzer harnesses for both
# native frame parsers (target side, initiator side, and the initiator side
# with lone requests awaited by a spinning thread: lone_frames; native/fuzz/, built with
# Debian clang -fsanitize=fuzzer,address,undefined) and atheris harnesses for
# the Python handshake and metadata decoder (fuzz/). Each runs until it has
# executed RUNS inputs (default 10 M) or MAX_TIME seconds passed, whichever
# comes first, then the table at the end says, per harness: executions,
# executions per second, coverage (libFuzzer's cov = edges, ft = features),
# corpus size and crashes.
#
#   benchmarks/fuzz.sh [HARNESS...]   target_frames initiator_frames lone_frames handshake
#                                     metadata nixl_wire kv_peer kv_disk objects
#                                     discovery
#                                     (default: all, one after the other)
#   RUNS=10000000      executions per harness
#   MAX_TIME=0         seconds per harness (0: no limit)
#   MERGE=1            afterwards, minimize what was found into the committed
#                      corpus (fuzz/corpus/<harness>, -merge=1)
#   MERGE=add          afterwards, add to the committed corpus only the inputs
#                      that bring features it lacks, keeping all it has (a
#                      Python harness run without coverage-instrumented
#                      msgspec sees fewer features: MERGE=1 then shrank the
#                      nixl_wire corpus 696 -> 118 files, dropping inputs only
#                      msgspec's edges told apart)
#   OUT=build-fuzz     work dir: binaries, growing corpora, logs, crash inputs
#
# Needs: clang and libclang-rt-14-dev (Debian), atheris (pip) for the Python
# harnesses. Runs niced: the machines this runs on are shared. A crash input
# lands in $OUT/artifacts/<harness>/; replay one with the harness and its path
# (native: $OUT/fuzz_<harness> FILE; Python: python fuzz/fuzz_<harness>.py FILE).
# Leak checks per input are off (-detect_leaks=0): the engine keeps a record of
# every connection until it is destroyed, so every input "leaks" until the
# harness recycles the engine; the corpus replay (tests/test_fuzz_replay.py)
# runs under LeakSanitizer with the engine destroyed at the end instead.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

RUNS=${RUNS:-10000000}
MAX_TIME=${MAX_TIME:-0}
MERGE=${MERGE:-0}
OUT=${OUT:-build-fuzz}
PY=${PYTHON:-python3}
ALL=(target_frames initiator_frames lone_frames handshake metadata nixl_wire kv_peer kv_disk objects
     discovery)
HARNESSES=("$@")
[ ${#HARNESSES[@]} -eq 0 ] && HARNESSES=("${ALL[@]}")

mkdir -p "$OUT"
native_needed=0
for h in "${HARNESSES[@]}"; do
    case $h in
    target_frames | initiator_frames | lone_frames) native_needed=1 ;;
    handshake | metadata | nixl_wire | kv_peer | kv_disk | objects | discovery) ;;
    *) echo "unknown harness: $h (one of: ${ALL[*]})" >&2; exit 2 ;;
    esac
done
if [ $native_needed = 1 ]; then
    nice -n 10 native/fuzz/build.sh "$OUT" >/dev/null
fi
"$PY" fuzz/make_seeds.py "$OUT/seeds" >/dev/null

# The Python harnesses' decoding happens in msgspec's C code: for coverage
# there, msgspec (the version installed) is rebuilt with clang's coverage
# instrumentation into $OUT/pycov, and libFuzzer (Debian's
# libclang_rt.fuzzer_no_main) is preloaded as a shared library so that build
# and atheris share one libFuzzer. Without it (no clang runtime, no network
# for the sdist), the harnesses still run, guided by Python coverage only.
python_cov() {
    local rt so ver
    so="$OUT/pycov/libfuzzer_no_main.so"
    ver=$("$PY" -c 'import importlib.metadata as m; print(m.version("msgspec"))')
    if [ ! -e "$OUT/pycov/.msgspec-$ver" ]; then
        rm -rf "$OUT/pycov"
        mkdir -p "$OUT/pycov"
        rt=$(clang -print-file-name=libclang_rt.fuzzer_no_main-x86_64.a 2>/dev/null || true)
        [ -f "$rt" ] || rt=$(find /usr/lib/llvm-*/lib/clang -name 'libclang_rt.fuzzer_no_main-x86_64.a' 2>/dev/null | head -1)
        [ -f "$rt" ] || return 1
        clang -shared -fPIC -o "$so" -Wl,--whole-archive "$rt" -Wl,--no-whole-archive \
            -lstdc++ -lpthread || return 1
        CC=clang LDSHARED="clang -shared" \
            CFLAGS="-fsanitize-coverage=inline-8bit-counters,pc-table,trace-cmp -O1 -g" \
            nice -n 10 "$PY" -m pip install -q --no-deps --no-binary msgspec \
            --target "$OUT/pycov/site" "msgspec==$ver" >"$OUT/pycov/build.log" 2>&1 || return 1
        touch "$OUT/pycov/.msgspec-$ver"
    fi
    PYCOV_ENV=(env "LD_PRELOAD=$ROOT/$so" "PYTHONPATH=$ROOT/$OUT/pycov/site${PYTHONPATH:+:$PYTHONPATH}")
}
PYCOV_ENV=(env)
for h in "${HARNESSES[@]}"; do
    if [ "$h" != target_frames ] && [ "$h" != initiator_frames ] && [ "$h" != lone_frames ]; then
        python_cov || echo "note: no coverage-instrumented msgspec (see $OUT/pycov/build.log):" \
            "the Python harnesses are guided by Python coverage only"
        break
    fi
done

# Sanitizer settings for the runs: stop at the first error, with a stack.
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=0:allocator_may_return_null=1:quarantine_size_mb=64}
# Python harnesses: a known, reported issue (fuzz/known_issues.py) is said once
# and the run goes on; AXF_FUZZ_TOLERATE_KNOWN=0 stops at it like at any crash.
export AXF_FUZZ_TOLERATE_KNOWN=${AXF_FUZZ_TOLERATE_KNOWN:-1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}

# Source-level coverage of the parser functions a native harness drives,
# from a replay of its work corpus through an llvm-cov build.
declare -a PARSER_COV=()
parser_cov() { # parser_cov HARNESS CORPUS FUNCTION...
    local h=$1 corpus=$2
    shift 2
    command -v llvm-profdata >/dev/null && command -v llvm-cov >/dev/null || return 0
    nice -n 10 native/fuzz/build.sh --coverage "$OUT/cov" >/dev/null # incremental
    rm -f "$OUT/cov/$h.profraw"
    LLVM_PROFILE_FILE="$OUT/cov/$h.profraw" nice -n 10 "$OUT/cov/fuzz_$h" "$corpus" >/dev/null
    llvm-profdata merge -o "$OUT/cov/$h.profdata" "$OUT/cov/$h.profraw"
    local report f
    report=$(llvm-cov report -show-functions "$OUT/cov/fuzz_$h" \
        -instr-profile="$OUT/cov/$h.profdata" native/src/conn.c)
    for f in "$@"; do
        # columns: name, regions, miss, cover, lines, miss, cover, branches, miss, cover
        PARSER_COV+=("$(awk -v f="conn.c:$f" -v h="$h" '$1 == f {
            printf "%-17s %-22s lines %s/%s (%s)  branches %s/%s (%s)", h, f, $5 - $6, $5, $7,
                $8 - $9, $8, $10 }' <<<"$report")")
    done
}

declare -a ROWS=()
for h in "${HARNESSES[@]}"; do
    corpus="$OUT/corpus/$h"
    arts="$OUT/artifacts/$h"
    log="$OUT/logs/$h-$(date -u +%Y%m%dT%H%M%S).log"
    mkdir -p "$corpus" "$arts" "$OUT/logs"
    # The committed corpus and the seeds are where each run starts.
    [ -d "fuzz/corpus/$h" ] && cp -n "fuzz/corpus/$h"/* "$corpus"/ 2>/dev/null || true
    cp -n "$OUT/seeds/$h"/* "$corpus"/ 2>/dev/null || true
    # Inputs naming an older protocol version stop at the version check: a
    # copy of each naming the current one (make_seeds.py --reversion).
    case $h in
    handshake | metadata) "$PY" fuzz/make_seeds.py --reversion "$corpus" ;;
    esac
    # Native: under ASan the process grows by ~400 bytes per input (two
    # engine threads each; the same harness without ASan stays flat at 30 MB
    # over 300 k inputs), so 10 M inputs need room.
    case $h in
    target_frames | initiator_frames | lone_frames) cmd=("$OUT/fuzz_$h") rss=8192 ;;
    *) cmd=("${PYCOV_ENV[@]}" "$PY" "fuzz/fuzz_$h.py") rss=4096 ;;
    esac
    args=(-runs="$RUNS" -max_total_time="$MAX_TIME" -detect_leaks=0 -print_final_stats=1
          -artifact_prefix="$arts/" -max_len=4096 -timeout=30 -rss_limit_mb=$rss)
    echo "==================== $h: up to $RUNS executions$([ "$MAX_TIME" != 0 ] && echo ", $MAX_TIME s")"
    t0=$(date +%s)
    set +e
    nice -n 10 "${cmd[@]}" "${args[@]}" "$corpus" >"$log" 2>&1
    rc=$?
    set -e
    secs=$(($(date +%s) - t0))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
    cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
    ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
    files=$(find "$corpus" -type f | wc -l)
    bytes=$(du -sb "$corpus" | cut -f1)
    # crash-, timeout-, oom-, leak- inputs; slow-unit- ones (over 10 s, e.g.
    # a stopped or starved process) are not findings by themselves.
    crashes=$(find "$arts" -type f ! -name 'slow-unit-*' | wc -l)
    status=ok
    [ $rc -ne 0 ] && status="exit $rc"
    known=$(sed -n 's/^known issue hit (tolerated): \([^:]*\):.*/\1/p' "$log" | sort -u | paste -sd, -)
    [ -n "$known" ] && status="$status, known issues hit: $known"
    tail -n 3 "$log" | sed 's/^/    /'
    ROWS+=("$(printf '%-17s %12s %8s %7s %7s %6s %9s %7s %4ss %s' "$h" "${execs:-?}" \
        "${rate:-?}" "${cov:-?}" "${ft:-?}" "$files" "$bytes" "$crashes" "$secs" "$status")")
    case $h in
    target_frames) parser_cov "$h" "$corpus" rx_main rx_target target_region || true ;;
    initiator_frames) parser_cov "$h" "$corpus" rx_main rx_initiator initiator_conn_lost || true ;;
    lone_frames) parser_cov "$h" "$corpus" rx_initiator help_read help_takes help_more || true ;;
    esac
    if [ "$MERGE" = add ] && [ $rc -eq 0 ]; then
        mkdir -p "fuzz/corpus/$h"
        n0=$(find "fuzz/corpus/$h" -type f | wc -l)
        if ! PATH="$(dirname "$(command -v "$PY")"):$PATH" nice -n 10 "${cmd[@]}" -merge=1 \
            -detect_leaks=0 -max_len=4096 -timeout=30 -rss_limit_mb=$rss "fuzz/corpus/$h" \
            "$corpus" >"$OUT/logs/$h.merge.log" 2>&1; then
            echo "merge failed (see $OUT/logs/$h.merge.log)"
            ROWS[-1]="${ROWS[-1]}, merge failed"
            continue
        fi
        echo "    corpus grown: $n0 -> $(find "fuzz/corpus/$h" -type f | wc -l) files," \
            "$(du -sb "fuzz/corpus/$h" | cut -f1) bytes in fuzz/corpus/$h"
    fi
    if [ "$MERGE" = 1 ] && [ $rc -eq 0 ]; then
        # Minimize into a fresh dir, then replace the committed corpus with it.
        # libFuzzer's merge runs argv[0] again: for the Python harnesses that
        # is the script, whose shebang must find this Python.
        rm -rf "$OUT/merged/$h"
        mkdir -p "$OUT/merged/$h" "fuzz/corpus/$h"
        if ! PATH="$(dirname "$(command -v "$PY")"):$PATH" nice -n 10 "${cmd[@]}" -merge=1 \
            -detect_leaks=0 -max_len=4096 -timeout=30 -rss_limit_mb=$rss "$OUT/merged/$h" \
            "$corpus" >"$OUT/logs/$h.merge.log" 2>&1 || [ -z "$(ls -A "$OUT/merged/$h")" ]; then
            echo "merge failed (see $OUT/logs/$h.merge.log): fuzz/corpus/$h left as it was"
            ROWS[-1]="${ROWS[-1]}, merge failed"
            continue
        fi
        rm -f "fuzz/corpus/$h"/*
        cp "$OUT/merged/$h"/* "fuzz/corpus/$h"/
        echo "    corpus minimized: $(find "fuzz/corpus/$h" -type f | wc -l) files," \
            "$(du -sb "fuzz/corpus/$h" | cut -f1) bytes in fuzz/corpus/$h"
    fi
done

echo
echo "==================== fuzz summary ($(date -u +%FT%TZ), $(uname -m), $(nproc) cores)"
printf '%-17s %12s %8s %7s %7s %6s %9s %7s %5s %s\n' harness executions exec/s cov ft \
    files bytes crashes time status
printf '%s\n' "${ROWS[@]}"
echo "cov: edges (libFuzzer's coverage counters; Python harnesses: atheris' bytecode"
echo "counters plus msgspec's C code where instrumented); ft: features; files/bytes: the"
echo "work corpus in $OUT/corpus"
if [ ${#PARSER_COV[@]} -gt 0 ]; then
    echo
    echo "parser coverage (llvm-cov, native/src/conn.c, replay of the work corpus):"
    printf '%s\n' "${PARSER_COV[@]}"
fi
for r in "${ROWS[@]}"; do
    [[ $r == *" ok"* ]] || exit 1
done
