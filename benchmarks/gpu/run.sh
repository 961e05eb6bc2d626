#!/usr/bin/env bash
# The one command on the device machine (README.md beside this file): the carried wheels
# (jax_ucp's dependencies the image lacks) installed into /tmp/site, then run.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
wheels="${WHEELS:-.whl}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
PYTHONUNBUFFERED=1 exec python3 benchmarks/gpu/run.py "$@"
