#!/usr/bin/env bash
# GPU checks, as one script for a CUDA machine with torch and transformers but no network:
#   1. the engine's numerics tests on CUDA (tiny random models of five architectures);
#   2. a randomly initialised Qwen2.5-14B-shaped model (48 layers, bf16): a 50-item `stagereplay matched`;
#   3. bench/decode.py on the toy, the 50M model and the 14B-shaped model.
# Outputs land in $OUT (default ./gpu-out). Missing pure-Python wheels can be given in .whl/.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

echo "== 1. engine tests on CUDA"
STAGEREPLAY_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py 2>&1 | tail -15

echo "== 2. Qwen2.5-14B-shaped random model, 50-item matched"
timeout 200 python3 bench/random_model.py --shape qwen2.5-14b --out /tmp/q14b --device cuda
time timeout 330 python3 -m stagereplay.cli matched --model /tmp/q14b --data /tmp/q14b/items.jsonl --n 50 \
  --boundary-after 16 --max-new-tokens 32 --device cuda --out /tmp/matched14b
cp /tmp/matched14b/results.json "$OUT/matched14b_results.json"
cp /tmp/matched14b/report.md "$OUT/matched14b_report.md"

echo "== 3. decode throughput"
timeout 90 python3 bench/decode.py --device cuda --models toy,50m --tokens 64 --prompts 4 --repeats 3 \
  --json "$OUT/decode_cuda.json"
timeout 120 python3 bench/decode.py --device cuda --models toy --model /tmp/q14b --tokens 64 --prompts 2 \
  --repeats 3 --json "$OUT/decode_cuda_14b.json"
