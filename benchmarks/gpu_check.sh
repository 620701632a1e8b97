#!/usr/bin/env bash
# GPU check, run on a machine with a CUDA device (e.g. the lent H200) within ~5 minutes:
#   bash benchmarks/gpu_check.sh            # results under $OUT (default: benchmarks/results/gpu)
# Installs the project as the README says (plus the bench extra), runs the GPU tests, then
# the training-throughput benchmark on the GPU at batch 16384, and writes JSON + logs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
pip install -q -e ".[dev,bench]" 2>&1 | tail -n 2
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/device.txt" || true
timeout 120 python -m pytest -m gpu -q tests 2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 5
timeout 150 python benchmarks/train_throughput.py --device cuda --batch 16384 --rounds 1 \
    --steps 30 --out "$OUT/train_throughput_gpu.json" 2>&1 | tee "$OUT/train_throughput_gpu.txt" | tail -n 12
echo "results in $OUT"
