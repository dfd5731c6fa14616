#!/usr/bin/env bash
# The Python environment the bed's jobs run their workloads with, built once on the "node".
#
# A process started over SSH on the Slurm node does not see the login shell's pip settings, and a
# task's `setup` would otherwise install torch on every launch: like a real cluster with a shared
# environment, the bed's fleet (testbed/fleet.yaml) points jobs at this one via GPUDOOR_PYTHON.
# Idempotent: a second run only checks the imports.
set -euo pipefail
ENV_DIR="${GPUDOOR_TESTBED_NODE_ENV:-/var/lib/gpudoor-testbed/nodeenv}"
NEED="import torch, PIL, boto3, pandas, pyarrow, dagster_pipes"
# The jobs run as the login user, who cannot write into this root-owned environment: its bytecode is compiled
# here, once (otherwise every job would compile torch and pandas from source as it imports them).
compiled() { "$ENV_DIR/bin/python" -m compileall -q -j 0 "$("$ENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null; }
if [[ -x "$ENV_DIR/bin/python" ]] && "$ENV_DIR/bin/python" -c "$NEED" 2>/dev/null; then
  compiled || true
  echo "node env ready: $ENV_DIR"
  exit 0
fi
if ! /usr/bin/python3 -c 'import ensurepip' 2>/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends python3-venv >/dev/null
fi
mkdir -p "$(dirname "$ENV_DIR")"
/usr/bin/python3 -m venv "$ENV_DIR"
# uv installs (as for the project's environment, see the Makefile); pip's find-links hold the on-disk CPU
# wheel of torch (no multi-GB CUDA download).
"$ENV_DIR/bin/pip" install -q 'uv==0.13.9' 2>&1 | grep -v "is ignored" || true
UV_FIND_LINKS="${UV_FIND_LINKS:-${PIP_FIND_LINKS:-$("$ENV_DIR/bin/pip" config get global.find-links 2>/dev/null)}}" \
  UV_SYSTEM_CERTS=1 "$ENV_DIR/bin/uv" pip install -q --compile-bytecode --python "$ENV_DIR/bin/python" \
  'torch==2.13.0' pillow boto3 pandas pyarrow 'dagster-pipes==1.13.27'
"$ENV_DIR/bin/python" -c "$NEED"
chmod -R a+rX "$ENV_DIR"
echo "node env built: $ENV_DIR"
