#!/usr/bin/env bash
# GPU check, on the lent GPU machine (no package index there) in under 8 minutes:
#   bash benchmarks/gpu_wheels.sh           # here first: the wheels it lacks, into .wheels/
#   device run: bash benchmarks/gpu_check.sh   with carry [".wheels"]; JSON + logs in $OUT
#   bash benchmarks/gpu_check.sh --dry-run  # here: the same steps on the CPU, against an
#                                           # emulation of the GPU image (gpu_image.py)
# It installs nothing over the machine's own packages (its torch stays): the carried wheels
# go to a private --target on PYTHONPATH with the repository, so every step runs Sampan
# from source. Steps: the GPU tests (same numbers as on CPU, bf16 autocast), training
# throughput on CUDA at batch 16384 for DeepFM, DCNv2 and DIN with plain PyTorch beside it,
# the embedding lookup + row-update bandwidth against the GPU's copy bandwidth, and the
# dynamic table's key -> row map (throughput, evictions, memory).
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; fi
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
PY=$(command -v python3 || command -v python)
TAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if ! ls ".wheels/$TAG/"*.whl >/dev/null 2>&1; then
  echo "no carried wheels for $TAG in .wheels/$TAG: run 'bash benchmarks/gpu_wheels.sh' on a" \
       "machine with a package index, then carry .wheels" >&2
  exit 2
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" ".wheels/$TAG/"*.whl
if [ "$DRY" = 1 ]; then
  # a Python that sees only what the GPU image has, plus the carried wheels
  "$PY" benchmarks/gpu_image.py --emulate "$WORK/image"
  "$PY" -m venv --without-pip "$WORK/venv"
  PY="$WORK/venv/bin/python"
  export PYTHONPATH="$WORK/site:$PWD:$WORK/image"
  if "$PY" -c "import fastapi" 2>/dev/null; then  # the image has no fastapi: prove isolation
    echo "dry run: the emulated GPU image sees packages the image lacks" >&2
    exit 1
  fi
  DEVICE=cpu BATCH=512 STEPS=6 ROWS=200000 DYN="--quick"
else
  export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  DEVICE=cuda BATCH=16384 STEPS=30 ROWS=4000000 DYN="--stream 20000000"
fi
export PYTHONUNBUFFERED=1
"$PY" - <<'PYEOF' | tee "$OUT/device.txt"
import platform, sys, torch, pydantic, sampan
print("python", platform.python_version(), "torch", torch.__version__, "pydantic",
      pydantic.__version__, "sampan", sampan.__file__)
print("cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PYEOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/device.txt" 2>/dev/null || true
set -o pipefail
timeout 120 "$PY" -m pytest -o addopts="" -m gpu -q -p no:cacheprovider tests/integration/test_gpu.py 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -n 5
timeout 270 "$PY" benchmarks/train_throughput.py --device "$DEVICE" --batch "$BATCH" \
    --models deepfm,dcn_v2,din --contenders sampan,plain --rounds 1 --steps "$STEPS" \
    --data-rows $((BATCH * 8)) --out "$OUT/train_throughput_gpu.json" 2>&1 \
    | tee "$OUT/train_throughput_gpu.txt" | tail -n 12
timeout 60 "$PY" benchmarks/embedding_bandwidth.py --device "$DEVICE" --batch "$BATCH" \
    --rows "$ROWS" --json "$OUT/embedding_bandwidth.json" 2>&1 | tee "$OUT/embedding.txt"
timeout 120 "$PY" benchmarks/dynamic_embedding.py --device "$DEVICE" $DYN \
    --out "$OUT/dynamic_embedding.json" 2>&1 | tee "$OUT/dynamic_embedding.txt" | tail -n 12
echo "results in $OUT"
