#!/usr/bin/env bash
# Builds the native frame-parser fuzz harnesses, against the engine's own
# sources (native/src/*.c), outside meson (the project's build stays as it is).
#
#   native/fuzz/build.sh [OUTDIR]           libFuzzer binaries (Debian clang:
#                                           -fsanitize=fuzzer,address,undefined;
#                                           needs libclang-rt-14-dev)
#   native/fuzz/build.sh --replay [OUTDIR]  the same harnesses with a plain
#                                           main() that replays files/dirs once,
#                                           under ASan/UBSan ($CC, else clang,
#                                           else cc): what CI runs on the corpus
#   native/fuzz/build.sh --coverage [OUTDIR] the replay build with clang's
#                                           source-based coverage (llvm-cov)
#
# OUTDIR defaults to build-fuzz (or build-fuzz-replay). Prints the binaries.
set -euo pipefail
cd "$(dirname "$0")/../.."

mode=fuzz
case ${1:-} in
--replay) mode=replay; shift ;;
--coverage) mode=coverage; shift ;;
esac
out=${1:-build-fuzz$([ $mode != fuzz ] && echo "-$mode" || true)}
mkdir -p "$out/obj"

if [ $mode = fuzz ]; then
    cc=${CC:-clang}
    # The engine gets coverage counters and comparison tracing; the harness
    # links libFuzzer's main.
    eng_san=(-fsanitize=fuzzer-no-link,address,undefined)
    exe_san=(-fsanitize=fuzzer,address,undefined)
elif [ $mode = coverage ]; then
    # Source-based coverage (llvm-cov) of a corpus replay: which lines and
    # branches of the parsers the corpus reaches.
    cc=${CC:-clang}
    eng_san=(-fprofile-instr-generate -fcoverage-mapping)
    exe_san=(-fprofile-instr-generate -fcoverage-mapping)
else
    cc=${CC:-$(command -v clang || command -v cc)}
    eng_san=(-fsanitize=address,undefined)
    exe_san=(-fsanitize=address,undefined)
fi
common=(-std=c11 -g -O1 -fno-omit-frame-pointer -fno-sanitize-recover=undefined
        -Inative/include -Inative/src -pthread)

# Every engine source but the verbs table (without AXF_HAVE_VERBS the verbs
# transport is absent from the registry; verbs.c keeps only the public calls'
# "not built" answers) and the test-only mock transport. Not our code to hold
# to -Werror under another compiler: warnings only.
objs=()
for src in native/src/*.c; do
    base=$(basename "$src" .c)
    [ "$base" = verbs_table ] || [ "$base" = mock ] && continue
    obj="$out/obj/$base.o"
    if [ ! -e "$obj" ] || [ "$src" -nt "$obj" ] || [ native/src/internal.h -nt "$obj" ] ||
        [ native/src/transport.h -nt "$obj" ] ||
        [ native/include/aioxfer.h -nt "$obj" ] || [ "$0" -nt "$obj" ]; then
        "$cc" "${common[@]}" "${eng_san[@]}" -c "$src" -o "$obj"
    fi
    objs+=("$obj")
done

# Our harness code is held to the project's standard.
strict=(-Wall -Wextra -Werror)
for h in native/fuzz/fuzz_*_frames.c; do
    name=$(basename "$h" .c)
    extra=()
    [ $mode != fuzz ] && extra=(native/fuzz/replay_main.c)
    "$cc" "${common[@]}" "${strict[@]}" "${exe_san[@]}" "$h" "${extra[@]}" "${objs[@]}" \
        -ldl -o "$out/$name"
    echo "$out/$name"
done
