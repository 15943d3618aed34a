#!/usr/bin/env bash
# CUDA checks as one script for a GPU machine with torch and transformers but no network (at most 8 minutes
# on one H200; nothing is downloaded). It ends with one table (also in $OUT/gpu_check.txt):
#   1. tiny random models of every architecture: live loop == generate(), bitwise, on CUDA (tests/test_engine.py);
#   2. the embedded toy's `matched` in bf16 on all 200 held-out items, its divergence count beside the CPU's;
#   3. a random Qwen2 of R1-Distill-Qwen-14B's shape on 8 prompts, 1,024-token stage 1: our loop's tokens/s vs
#      generate()'s, equal tokens, the boundary fingerprint's time and peak GPU memory (bench/gpu_check.py).
# Missing pure-Python wheels can be given in .whl/.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

echo "== 1. tiny architectures on CUDA"
STAGEREPLAY_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py \
  -k "live_loop_equals_generate or incremental_is_bit_exact" 2>&1 | tee "$OUT/tests.txt" | tail -5
SUMMARY=$(grep -Eo '[0-9]+ (passed|failed)[^=]*' "$OUT/tests.txt" | tail -1)

echo "== 2. toy matched, bf16, 200 items, CUDA"
rm -rf /tmp/toy-cuda
timeout 120 python3 -m stagereplay.cli matched --device cuda --n 200 --quiet --out /tmp/toy-cuda
cp /tmp/toy-cuda/results.json "$OUT/toy_cuda_results.json" 2>/dev/null

echo "== 3. R1-Distill-14B-shaped random model"
timeout 270 python3 bench/gpu_check.py --tests-summary "${SUMMARY:-not run}" --toy-run /tmp/toy-cuda --out "$OUT"
