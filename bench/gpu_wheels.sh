#!/usr/bin/env bash
# Wheels for what the GPU machine's image lacks, into .whl/ (git-ignored; carried beside the working tree, where
# bench/gpu_check.sh installs them without the network). The image has Python 3.12, torch, transformers,
# tokenizers, safetensors, numpy, scipy, typer, rich, matplotlib, pyarrow and sympy
# (/work/.library/device/KINDS.md lists it); of stagereplay's dependencies and theirs it lacks these. Each is
# pinned to the version this environment runs (the one the tests pass with), for CPython 3.12 manylinux x86_64.
#
#   bash bench/gpu_wheels.sh             # download into .whl/
#   bash bench/gpu_wheels.sh --dry-run   # print what it would download
set -euo pipefail
cd "$(dirname "$0")/.."
MISSING=(pydantic pydantic-core annotated-types typing-inspection typing-extensions math-verify latex2sympy2_extended
         antlr4-python3-runtime)
DEST=$PWD/.whl
PY=${PYTHON:-python3}
SPECS=()
for name in "${MISSING[@]}"; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") \
    || { echo "error: $name is not installed here; install stagereplay's dependencies first (pip install -e .)"; exit 2; }
  SPECS+=("$name==$version")
done
CMD=("$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
     --abi abi3 --abi none --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any
     -d "$DEST" "${SPECS[@]}")
if [ "${1:-}" = "--dry-run" ]; then
  echo "${CMD[*]}"
  echo "would download ${#SPECS[@]} wheels into $DEST for CPython 3.12 manylinux x86_64"
  exit 0
fi
mkdir -p "$DEST"
"${CMD[@]}"
echo "downloaded ${#SPECS[@]} wheels into $DEST for CPython 3.12 manylinux x86_64: $(cd "$DEST" && ls ./*.whl | tr '\n' ' ')"
