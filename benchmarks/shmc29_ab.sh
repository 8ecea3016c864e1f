#!/bin/bash
# shmc29's A/B under one benchlock: the demo's throughput (512 MiB written
# right after connecting: the first bulk writes), interleaved pairs, then
# connect_phases interleaved, then run.py's connect row beside Mooncake
# (and with ROWS=1 its shm copy rows, quick, before beside after).
# usage: benchmarks/shmc29_ab.sh BEFORE_PY AFTER_PY PAIRS OUTDIR
set -u
A=$1 B=$2 N=$3 OUT=$4
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
cd /
for i in $(seq "$N"); do
  for py in "$A" "$B"; do
    g=$("$py" -m aioxfer demo --no-progress 2>&1 | sed -n 's/^throughput: \([0-9.]*\) GB.*/\1/p')
    echo "$py $g" >> "$OUT/demo.txt"
  done
done
"$A" "$HERE/connect_phases.py" --transport shm -n 25 --python "$A" --python "$B" \
  > "$OUT/phases.txt" 2>&1
"$A" "$HERE/peers/run.py" --connect-only --only mooncake,aioxfer_shm,before_shm \
  --connect-samples 21 --aioxfer-python "$B" --aioxfer-before-python "$A" --out "$OUT/peers" \
  > "$OUT/peers.txt" 2>&1
# The copy rows (256 x 16 KiB batch, shm one at a time), before beside after.
if [ -n "${ROWS:-}" ]; then
  "$A" "$HERE/peers/run.py" --quick --rounds 3 --no-limits --only aioxfer_shm,before_shm \
    --aioxfer-python "$B" --aioxfer-before-python "$A" --out "$OUT/rows" > "$OUT/rows.txt" 2>&1
fi
