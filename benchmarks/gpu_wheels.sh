#!/usr/bin/env bash
# Prepare the wheels that benchmarks/gpu_check.sh carries to the GPU machine, which has no
# package index. Run it here (a machine that reaches PyPI), from anywhere:
#   bash benchmarks/gpu_wheels.sh
# It fills .wheels/cp312 (the GPU machine's Python 3.12) and .wheels/cpXY for this
# machine's Python (what `gpu_check.sh --dry-run` installs), with the versions installed
# here, for the packages Sampan needs that the GPU image lacks (benchmarks/gpu_image.py
# lists what it has). .wheels/ is ignored by git: name it in the device run's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=$(python benchmarks/gpu_image.py --missing)
echo "carried: $PKGS"
HERE=$(python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
for v in 3.12 "$HERE"; do
  tag="cp${v/./}"
  rm -rf ".wheels/$tag"
  # shellcheck disable=SC2086
  pip download -q --only-binary=:all: --no-deps --python-version "$v" --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 -d ".wheels/$tag" $PKGS
  echo ".wheels/$tag: $(ls ".wheels/$tag" | tr '\n' ' ')"
done
