#!/bin/sh
# The engine's own figures, without Python: builds one of these programs
# against the C sources of a tree (this one by default), e.g. to compare two
# commits (git archive <commit> native | tar -x -C /tmp/before).
#   tcplat.c   lone 4 KiB WRITE/READ round trips over TCP loopback, two
#              processes, the initiator waiting as the adaptive loop does:
#              ./tcplat [samples] [connections] [bytes] [write|read]
#   shmdemo.c  connect (import a touched memfd pool) + first 4 KiB write, then
#              the demo's workload into it: ./shmdemo <pool MiB>
# usage: build.sh <program.c> <output> [tree]
set -e
SRC=$1; OUT=$2; T=${3:-$(git rev-parse --show-toplevel)}
gcc -O2 -std=gnu11 -pthread -I"$T/native/include" -I"$T/native/src" -DAXF_HAVE_URING -o "$OUT" "$SRC" \
    "$T/native/src/engine.c" "$T/native/src/conn.c" "$T/native/src/control.c" "$T/native/src/tcp.c" \
    "$T/native/src/shm.c" "$T/native/src/file.c" "$T/native/src/cuda.c" "$T/native/src/transports.c" -ldl
