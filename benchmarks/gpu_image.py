"""What the lent GPU machine's Python has, for ``gpu_check.sh``.

``IMAGE`` lists the distributions of that machine's image (as read there on 2026-11-17).
``--missing`` prints the ones Sampan's GPU check needs that the image lacks, pinned to the
versions installed here (``gpu_wheels.sh`` downloads them). ``--emulate DIR`` fills ``DIR``
with links to this machine's copies of the image's distributions only, so that
``gpu_check.sh --dry-run`` runs against what the GPU machine has: a package the check needs
but neither carries nor finds there fails here first.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
from pathlib import Path

IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py
mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja
numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-
runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-
cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-
cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-
mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-
lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()

# what the GPU check imports beyond the image: Sampan's core requirements and their own
NEEDED = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing() -> list[str]:
    have = {norm(n) for n in IMAGE}
    return [f"{n}=={md.version(n)}" for n in NEEDED if norm(n) not in have]


def top_level(dist: md.Distribution) -> set[str]:
    """The importable names a distribution installs (packages, modules, .pth-free)."""
    names = set()
    for f in dist.files or []:
        first = f.parts[0]
        if first.endswith((".dist-info", ".egg-info")) or first in ("..", "__pycache__"):
            continue
        names.add(first)
    return names


def emulate(target: Path) -> list[str]:
    """Link this machine's copies of the image's distributions into ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    linked = []
    have = {norm(n) for n in IMAGE}
    for dist in md.distributions():
        name = dist.metadata["Name"] or ""
        if norm(name) not in have:
            continue
        root = Path(str(dist.locate_file("")))
        for item in top_level(dist) | {Path(str(dist._path)).name}:  # type: ignore[attr-defined]
            src, dst = root / item, target / item
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
        linked.append(name)
    return sorted(linked)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--missing", action="store_true")
    ap.add_argument("--emulate", type=Path)
    args = ap.parse_args()
    if args.missing:
        print(" ".join(missing()))
    if args.emulate:
        linked = emulate(args.emulate)
        print(f"{len(linked)} distributions of the GPU image linked into {args.emulate}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
