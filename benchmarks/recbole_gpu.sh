#!/usr/bin/env bash
# RecBole 1.2.1's SASRec on the partial MovieLens-1M (its 3,000 users), on a GPU machine
# that has no package index. RecBole trains on every prefix of every history: at length 200
# that is 478,653 sequences an epoch, about 2.7 h an epoch on 2 CPU cores
# (`recbole_sasrec.py --estimate`), so the next-item benchmark makes this row on a GPU.
#
#   bash benchmarks/recbole_gpu.sh --prepare   # here: RecBole's wheels and the events,
#                                              # into runs/recbole_gpu (ignored by git)
#   device run: bash benchmarks/recbole_gpu.sh   with carry ["runs/recbole_gpu"];
#                                              # writes $OUT/ml1m-3000-recbole.json
#   python benchmarks/sequential.py --datasets ml1m --max-users 3000 --models sasrec \
#       --reuse-sampan --recbole-result OUT/ml1m-3000-recbole.json
#
# The last command ranks RecBole's test predictions with Sampan's code against Sampan's run
# on the same events, and writes the RESULTS.md row. RecBole keeps its defaults (see
# recbole_sasrec.py) and stops early as usual, or after the epoch that passes LIMIT seconds
# of training (default 420: one device command may run 10 minutes); the row then says so.
# `PY=PYTHON bash benchmarks/recbole_gpu.sh --dry-run` runs the device steps here on the CPU
# for 2 batches (--estimate), with the carried wheels and a PYTHON that has what the GPU
# image has (torch, numpy, pandas, scipy, tqdm, tabulate, tensorboard) and no RecBole.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=runs/recbole_gpu
EVENTS="$DIR/ml1m-3000.tsv"
PY=${PY:-$(command -v python3 || command -v python)}
if [ "${1:-}" = "--prepare" ]; then
  mkdir -p "$DIR/wheels"
  "$PY" benchmarks/sequential.py --datasets ml1m --max-users 3000 --events-only
  cp runs/bench_sequential/ml1m-3000.tsv "$EVENTS"
  # pure-Python wheels (any Python 3); the GPU image has RecBole's other needs (numpy,
  # pandas, scipy, tqdm, tabulate, tensorboard, colorama)
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DIR/wheels" \
      recbole==1.2.1 colorlog==4.7.2 texttable==1.7.2 thop==0.1.1.post2209072238
  ls -l "$DIR/wheels" "$EVENTS"
  exit 0
fi
if ! ls "$DIR/wheels/"*.whl >/dev/null 2>&1 || [ ! -f "$EVENTS" ]; then
  echo "no carried wheels or events in $DIR: run 'bash benchmarks/recbole_gpu.sh --prepare'" \
       "on a machine with a package index, then carry $DIR" >&2
  exit 2
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" "$DIR/wheels/"*.whl
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "--dry-run" ]; then
  OUT="${OUT:-$DIR/dry_run}"
  mkdir -p "$OUT"
  "$PY" benchmarks/recbole_sasrec.py "$EVENTS" "$OUT/ml1m-3000-estimate.json" --max-len 200 \
      --device cpu --estimate 2
  exit 0
fi
OUT="${OUT:-$DIR/out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" benchmarks/recbole_sasrec.py "$EVENTS" "$OUT/ml1m-3000-recbole.json" --max-len 200 \
    --device cuda --epochs 60 --time-limit "${LIMIT:-420}" 2>&1 | tail -n 40
"$PY" - "$OUT/ml1m-3000-recbole.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print({k: r[k] for k in ("device", "epochs", "best_epoch", "seconds_to_best", "train_seconds",
                         "time_limited_after_epochs", "recbole_test")})
EOF
