#!/usr/bin/env bash
# RecBole 1.2.1's SASRec on a GPU machine that has no package index, for the next-item
# benchmark's rows that 2 CPU cores cannot make: RecBole trains on every prefix of every
# history, so the partial MovieLens-1M at length 200 (478,653 sequences an epoch) takes
# about 2.7 h an epoch on 2 cores (`recbole_sasrec.py --estimate`), and the whole Amazon
# sets take hours a run.
#
#   bash benchmarks/recbole_gpu.sh --prepare [DATASET ...]   # here: RecBole's wheels and
#       # the events of each DATASET (default ml1m-3000; also beauty, sports, toys, or
#       # NAME-N for the first N users) into runs/recbole_gpu, which git ignores
#   device run: bash benchmarks/recbole_gpu.sh [DATASET ...]  with carry ["runs/recbole_gpu"]
#       # writes $OUT/DATASET-recbole.json for each
#   python benchmarks/sequential.py --datasets ml1m --max-users 3000 --models sasrec \
#       --reuse-sampan --recbole-result OUT/ml1m-3000-recbole.json
#
# The last command ranks RecBole's test predictions with Sampan's code against Sampan's run
# on the same events (--reuse-sampan: the run already in runs/bench_sequential; without it
# Sampan trains again) and writes the RESULTS.md row. RecBole keeps its defaults (see
# recbole_sasrec.py) and stops early as usual, or after the epoch that passes LIMIT seconds
# of training (default 420, for one dataset in one 10-minute device command); the row then
# says so. `PY=PYTHON bash benchmarks/recbole_gpu.sh --dry-run [DATASET ...]` runs the
# device steps here on the CPU for 2 batches each (--estimate), with the carried wheels and
# a PYTHON that has what the GPU image has (torch, numpy, pandas, scipy, tqdm, tabulate,
# tensorboard) and no RecBole.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=runs/recbole_gpu
PY=${PY:-$(command -v python3 || command -v python)}
MODE=run
case "${1:-}" in --prepare|--dry-run) MODE=${1#--}; shift ;; esac
SETS=("$@")
[ ${#SETS[@]} -gt 0 ] || SETS=(ml1m-3000)
max_len() {  # the benchmark's history length for a dataset tag (ml1m-3000 -> ml1m's)
  case "${1%%-*}" in ml1m) echo 200 ;; beauty|sports|toys) echo 50 ;;
    *) echo "unknown dataset $1: expected beauty, sports, toys or ml1m, or NAME-N" >&2
       exit 2 ;;
  esac
}
if [ "$MODE" = prepare ]; then
  mkdir -p "$DIR/wheels"
  for tag in "${SETS[@]}"; do
    max_len "$tag" >/dev/null
    name=${tag%%-*}
    users=()
    [ "$name" != "$tag" ] && users=(--max-users "${tag#*-}")
    "$PY" benchmarks/sequential.py --datasets "$name" "${users[@]}" --events-only
    cp "runs/bench_sequential/$tag.tsv" "$DIR/$tag.tsv"
  done
  # pure-Python wheels (any Python 3); the GPU image has RecBole's other needs (numpy,
  # pandas, scipy, tqdm, tabulate, tensorboard, colorama)
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DIR/wheels" \
      recbole==1.2.1 colorlog==4.7.2 texttable==1.7.2 thop==0.1.1.post2209072238
  ls -l "$DIR/wheels" "$DIR/"*.tsv
  exit 0
fi
for tag in "${SETS[@]}"; do
  if [ ! -f "$DIR/$tag.tsv" ]; then
    echo "no events $DIR/$tag.tsv: run 'bash benchmarks/recbole_gpu.sh --prepare $tag'" \
         "on a machine with a package index, then carry $DIR" >&2
    exit 2
  fi
done
if ! ls "$DIR/wheels/"*.whl >/dev/null 2>&1; then
  echo "no carried wheels in $DIR/wheels: run 'bash benchmarks/recbole_gpu.sh --prepare'" >&2
  exit 2
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" "$DIR/wheels/"*.whl
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
if [ "$MODE" = dry-run ]; then
  OUT="${OUT:-$DIR/dry_run}"
  mkdir -p "$OUT"
  for tag in "${SETS[@]}"; do
    "$PY" benchmarks/recbole_sasrec.py "$DIR/$tag.tsv" "$OUT/$tag-estimate.json" \
        --max-len "$(max_len "$tag")" --device cpu --estimate 2
  done
  exit 0
fi
OUT="${OUT:-$DIR/out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
for tag in "${SETS[@]}"; do
  "$PY" benchmarks/recbole_sasrec.py "$DIR/$tag.tsv" "$OUT/$tag-recbole.json" \
      --max-len "$(max_len "$tag")" --device cuda --epochs 60 --time-limit "${LIMIT:-420}" \
      2>&1 | tail -n 20
  "$PY" - "$OUT/$tag-recbole.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[1], {k: r[k] for k in ("device_name", "epochs", "best_epoch", "seconds_to_best",
                                      "train_seconds", "time_limited_after_epochs",
                                      "recbole_test")})
EOF
done
