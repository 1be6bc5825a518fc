#!/usr/bin/env bash
# The prepared GPU run (benchmarks/gpu_check.py): the test suite on CUDA, the distributed paths on
# one GPU and the GPU benchmarks, written up in OUTDIR/report.md (and report.json).
#
#   bash benchmarks/gpu_check.sh OUTDIR [WHEELS_DIR] [gpu_check.py options: --budget S, --only a,b]
#
# For a machine without network access whose Python already has torch with CUDA: WHEELS_DIR holds
# wheel files of what it lacks (optree, and optionally heavyball, torchopt, graphviz), installed
# first into a temporary folder put on PYTHONPATH; the report says which optional packages were
# still missing. The project itself is used from this checkout (no install).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/gpu_check.sh OUTDIR [WHEELS_DIR] [options]}
shift
WHEELS=""
if [ $# -gt 0 ] && [ -d "$1" ]; then
    WHEELS=$1
    shift
fi
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
if [ -n "$WHEELS" ]; then
    SITE=$(mktemp -d)/site
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl >"$SITE.log" 2>&1; then
        echo "installed from $WHEELS: $(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')"
    else
        echo "installing the wheels of $WHEELS failed:"
        tail -5 "$SITE.log"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 benchmarks/gpu_check.py --out "$OUT" "$@"
