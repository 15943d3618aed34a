#!/usr/bin/env bash
# The GPU check in one script, for a GPU machine with torch and transformers but no network: at most 8 minutes
# on one H200, model construction included; nothing is downloaded. Each step runs under its own time budget and
# appends its rows to $OUT/gpu_check.txt as soon as they are measured (bench/gpu_check.py lists the steps):
#   the gpu-marked tests and the tiny architectures' live == generate() tests on CUDA; a random Qwen2.5-7B-shaped
#   model (152k vocabulary) drawn on the GPU; batch-1 decode of ours and generate(), dynamic and static, against
#   the bandwidth floor, a matched item's steps profiled, and the 14B paper's plan at the measured rate;
#   `matched` on 2 items with each cache of $CACHES (both arms,
#   replicas, fingerprints, diagnostics); the fp32 2x2 on those items. Rows: tokens/s, peak GPU memory against
#   `stagereplay plan`'s estimate, whether replicas are exact.
#
#   bash bench/gpu_check.sh                  # on the GPU machine; OUT=dir for the table and the runs
#   bash bench/gpu_check.sh --device cpu     # the same steps at a tiny shape, on a CPU (a minute or two)
#   CACHES=dynamic bash bench/gpu_check.sh   # the --cache values to run matched with (default: static,dynamic)
#
# The packages the GPU machine's image lacks (pydantic, math-verify and theirs) come as wheels in .whl/, made by
# bench/gpu_wheels.sh and carried beside the working tree; they are installed here, without the network.
set -uo pipefail
DEVICE=cuda
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    *) echo "error: unknown option $1; pass --device cuda|cpu"; exit 2 ;;
  esac
done
OUT=$(realpath -m "${OUT:-gpu-out}")
CACHES=${CACHES:-static,dynamic}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
# Only where they are missing: a machine that has them (this one, in the test suite) keeps its own.
if ! python3 -c "import pydantic, math_verify" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  SITE=$(mktemp -d)
  timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
    || { echo "error: the wheels in .whl/ did not install; rebuild them with bench/gpu_wheels.sh"; exit 2; }
  export PYTHONPATH="$SITE"
fi
export PYTHONPATH="$PWD/src:$PWD/bench:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
exec python3 bench/gpu_check.py all --device "$DEVICE" --out "$OUT" --caches "$CACHES"
