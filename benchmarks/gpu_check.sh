#!/usr/bin/env bash
# GPU check, on the lent GPU machine (no package index there) in 6 to 10 minutes:
#   bash benchmarks/gpu_wheels.sh           # here first: the wheels it lacks, into .wheels/
#   device run: bash benchmarks/gpu_check.sh   with carry [".wheels"]; JSON + logs in $OUT
#   bash benchmarks/gpu_check.sh --dry-run  # here: the same steps on the CPU, against an
#                                           # emulation of the GPU image (gpu_image.py);
#                                           # results in runs/gpu_dry_run
# It installs nothing over the machine's own packages (its torch stays): the carried wheels
# go to a private --target on PYTHONPATH with the repository, so every step runs Sampan
# from source. Steps, each under its own time limit so one slow step cannot eat the rest:
#  1. the GPU tests (`pytest -m gpu`: the same numbers as on CPU, bf16, export parity);
#  2. training throughput of DeepFM, DCNv2 and DIN at batch 16384 and 65536 in TF32 and bf16,
#     Sampan's Trainer against plain PyTorch, with the GPU's utilisation;
#     and where one DeepFM step's time goes (benchmarks/step_profile.py);
#  3. the embedding lookup + row-update bandwidth against the GPU's copy bandwidth;
#  4. the loader: memory-mapped store -> pinned -> GPU, in samples/s;
#  5. data parallel: 1 and 2 processes (on one GPU they share it, over gloo), test AUC with
#     its bootstrap interval;
#  6. the dynamic table's key -> row map on the GPU (throughput, evictions, memory).
# ONLY=step,step runs only those steps (names as in the log: gpu_tests, train_throughput, ...).
# Every step writes JSON into $OUT; `python benchmarks/gpu_report.py DIR --readme README.md`
# turns a run's JSON into the README's GPU block.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; fi
# a dry run's CPU figures never replace the committed GPU results
if [ "$DRY" = 1 ]; then OUT="${OUT:-runs/gpu_dry_run}"; else OUT="${OUT:-benchmarks/results/gpu}"; fi
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
"$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" ".wheels/$TAG/"*.whl || exit 2
if [ "$DRY" = 1 ]; then
  # a Python that sees only what the GPU image has, plus the carried wheels
  "$PY" benchmarks/gpu_image.py --emulate "$WORK/image" || exit 2
  "$PY" -m venv --without-pip "$WORK/venv"
  PY="$WORK/venv/bin/python"
  export PYTHONPATH="$WORK/site:$PWD:$WORK/image"
  if "$PY" -c "import fastapi" 2>/dev/null; then  # the image has no fastapi: prove isolation
    echo "dry run: the emulated GPU image sees packages the image lacks" >&2
    exit 1
  fi
  DEVICE=cpu BATCHES=512,1024 PRECISIONS=fp32,bf16 STEPS=6 BIG=1024 ROWS=200000
  # the limits are the GPU's time budget; here they only stop a step that hangs (bf16 on a
  # CPU without native bf16 runs about 14x slower than fp32)
  SCALE=3
  DYN="--quick" DIST_ROWS=100000
else
  export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  DEVICE=cuda BATCHES=16384,65536 PRECISIONS=tf32,bf16 STEPS=40 BIG=65536 ROWS=4000000
  SCALE=1
  DYN="--stream 10000000" DIST_ROWS=200000
fi
export PYTHONUNBUFFERED=1
FAILED=()
LOG="$OUT/gpu_check.log"  # every step's output, in one file (the device returns few files)
: > "$LOG"
step() {  # step NAME SECONDS COMMAND...: run it under its time limit, log it, note a failure
  local name=$1 limit=$(($2 * SCALE))
  shift 2
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then return; fi
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG" | tail -n 14
  local rc=${PIPESTATUS[0]}
  echo "== $name: rc $rc in $((SECONDS - t0))s" | tee -a "$LOG"
  [ "$rc" = 0 ] || FAILED+=("$name(rc $rc)")
}
"$PY" - <<'PYEOF' | tee "$OUT/device.txt"
import json, os, platform, sys, torch, pydantic, sampan
info = {"python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "pydantic": pydantic.__version__,
        "sampan": sampan.__file__, "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu_cores": os.cpu_count()}
try:
    import pynvml
    pynvml.nvmlInit()
    info["driver"] = pynvml.nvmlSystemGetDriverVersion()
except Exception as e:
    info["driver"] = None
try:
    import onnxruntime
    info["onnxruntime"] = onnxruntime.__version__
    info["onnxruntime_providers"] = onnxruntime.get_available_providers()
except Exception as e:
    info["onnxruntime"] = repr(e)
print(json.dumps(info))
PYEOF
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
    >> "$OUT/device.txt" 2>/dev/null || true
step gpu_tests 120 "$PY" -m pytest -o addopts="" -m gpu -q -p no:cacheprovider -rs \
    tests/integration/test_gpu.py
step train_throughput 210 "$PY" benchmarks/train_throughput.py --device "$DEVICE" \
    --batches "$BATCHES" --precisions "$PRECISIONS" --models deepfm,dcn_v2,din \
    --contenders sampan,sampan_host,plain --steps "$STEPS" --warmup 5 --compile none \
    --out "$OUT/train_throughput_gpu.json"
step step_profile 60 "$PY" benchmarks/step_profile.py --device "$DEVICE" --model deepfm \
    --batch "$BIG" --precision "${PRECISIONS%%,*}" --json "$OUT/step_profile.json"
step embedding_bandwidth 40 "$PY" benchmarks/embedding_bandwidth.py --device "$DEVICE" \
    --batch "$BIG" --rows "$ROWS" --json "$OUT/embedding_bandwidth.json"
step loader 60 "$PY" benchmarks/loader.py --device "$DEVICE" --batch "$BIG" --rows "$ROWS" \
    --out "$OUT/loader_gpu.json"
step distributed 200 "$PY" benchmarks/distributed.py --device "$DEVICE" --procs 1 2 \
    --rows "$DIST_ROWS" --bootstrap 200 --set train.log_every_steps=5 --timeout 100 \
    --json "$OUT/distributed_gpu.json"
step dynamic_embedding 60 "$PY" benchmarks/dynamic_embedding.py --device "$DEVICE" $DYN \
    --out "$OUT/dynamic_embedding.json"
echo "results in $OUT; failed: ${FAILED[*]:-none}"
[ ${#FAILED[@]} = 0 ]
