#!/usr/bin/env bash
# Installs the peers aioxfer is measured against, each into its own virtual environment,
# from the package registry, plus iperf3 (the TCP limit) and libibverbs1 (Mooncake's
# wheel will not import without it, even for TCP) from Debian. Safe to run again.
#
#   bash benchmarks/peers/install.sh          # venvs under $PEERS_VENVS (~/.cache/aioxfer-peers)
set -euo pipefail
V=${PEERS_VENVS:-$HOME/.cache/aioxfer-peers}
PY=${PYTHON:-python3}
mkdir -p "$V"

if ! command -v iperf3 >/dev/null || ! dpkg -s libibverbs1 >/dev/null 2>&1; then
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq iperf3 libibverbs1
fi

venv() {  # venv NAME: create $V/venv-NAME once
  [ -x "$V/venv-$1/bin/python" ] || "$PY" -m venv "$V/venv-$1"
}
have() {  # have NAME MODULE: the venv already imports MODULE
  "$V/venv-$1/bin/python" -c "import $2" >/dev/null 2>&1
}

# NIXL: the nixl-cu12 wheel carries UCX and runs on a CPU-only host. The wheels declare
# torch but never import it at run time: --no-deps keeps the venv ~340 MB instead of ~6 GB.
# (The meta package 1.5.2 pins cu12/cu13 wheels that were never published; 1.5.1 is whole.)
venv nixl
if ! have nixl "nixl._api, numpy"; then
  "$V/venv-nixl/bin/pip" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
  "$V/venv-nixl/bin/pip" install -q numpy
fi

# Mooncake Transfer Engine: the non-CUDA build (the CUDA one needs libcuda.so.1 to import).
venv mooncake
if ! have mooncake "mooncake.engine, numpy"; then
  "$V/venv-mooncake/bin/pip" install -q numpy mooncake-transfer-engine-non-cuda
fi

have nixl "nixl._api" && have mooncake "mooncake.engine"
echo "peers installed under $V: $(ls -d "$V"/venv-* | xargs -n1 basename | tr '\n' ' ')"
