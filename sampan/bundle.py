"""Reading a bundle: what ``sampan export RUN_DIR --out BUNDLE`` writes and the predictor
loads.

::

    BUNDLE/
      model.onnx | model.ts     the scoring graph (see sampan.export.graph)
      pipeline/                 the fitted FeaturePipeline (pipeline.json + .npy vocabularies)
      manifest.json             format, schema, input signature, config, metrics at export,
                                parity check, library versions, sha256 of every other file,
                                and the sha256 of the manifest itself

Opening a bundle checks it whole: the manifest's own checksum, every listed file's sha256,
that no listed path leaves the bundle, and that the bundle holds no file the manifest does
not list (an edited pipeline whose entry was removed is refused, not served). Any failure
is a :class:`~sampan.errors.BundleError` naming the file.

The graph takes *transformed* tensors; raw records become tensors in the predictor through
the same :class:`~sampan.data.pipeline.FeaturePipeline` code that prepared the training data,
so training and serving cannot disagree on a feature.

This module imports no torch: a server for an ONNX bundle runs without it (the writer is
:mod:`sampan.export.bundle`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from sampan.errors import BundleError

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 2: the manifest checksums itself and lists every file
MODEL_FILES = {"onnx": "model.onnx", "torchscript": "model.ts"}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON without its own ``manifest_sha256``."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def input_names(schema: Any) -> list[str]:
    """The graph's inputs, in order: ``dense``, ``sparse``, then one per sequence."""
    return ["dense", "sparse", *[s.name for s in schema.sequences]]


class Bundle:
    """An exported bundle opened for scoring: its manifest, pipeline and model runtime."""

    def __init__(self, path: str | Path, verify: bool = True,
                 manifest: dict[str, Any] | None = None):
        self.path = Path(path)
        if manifest is None:
            mf = self.path / MANIFEST
            if not mf.is_file():
                raise BundleError(f"{self.path} is not a Sampan bundle (no {MANIFEST}); "
                                  "create one with `sampan export RUN_DIR --out BUNDLE`")
            try:
                manifest = json.loads(mf.read_text())
            except (UnicodeDecodeError, ValueError) as e:
                raise BundleError(f"{mf} is not valid JSON ({e}); export the bundle "
                                  "again") from None
            if not isinstance(manifest, dict) or \
                    manifest.get("format_version") != FORMAT_VERSION:
                got = manifest.get("format_version") if isinstance(manifest, dict) else None
                raise BundleError(f"{mf}: format_version {got} is not supported (expected "
                                  f"{FORMAT_VERSION}); export the run again with this Sampan")
        self.manifest = manifest
        if verify:
            self.verify()
        from sampan.schema import DataSchema

        self.schema = DataSchema.from_json(manifest["schema"])
        self._session: _Session | None = None
        self._pipeline = None

    def file(self, rel: str) -> Path:
        """The path of the bundle's file ``rel``, which must be one the manifest lists (when
        the bundle was verified) and inside the bundle."""
        files = self.manifest.get("files")
        if files is not None and rel not in files and not any(
                f.startswith(rel.rstrip("/") + "/") for f in files):
            raise BundleError(f"bundle {self.path}: {rel!r} is not among the files its "
                              f"{MANIFEST} lists")
        return self._inside(rel)

    def _inside(self, rel: str) -> Path:
        root = self.path.resolve()
        p = (self.path / rel).resolve()
        if not isinstance(rel, str) or Path(rel).is_absolute() or ".." in Path(rel).parts \
                or not p.is_relative_to(root):
            raise BundleError(f"bundle {self.path}: {MANIFEST} names {rel!r}, a path outside "
                              "the bundle; refusing it")
        return p

    def verify(self) -> None:
        """Check the whole bundle against its manifest (see the module docstring)."""
        m = self.manifest
        if m.get("manifest_sha256") != manifest_digest(m):
            raise BundleError(f"bundle {self.path}: {MANIFEST} does not match its own sha256 "
                              "(modified after export?)")
        files = m.get("files")
        if not isinstance(files, dict):
            raise BundleError(f"bundle {self.path}: {MANIFEST} lists no files")
        for rel, digest in files.items():
            p = self._inside(rel)
            if not p.is_file():
                raise BundleError(f"bundle {self.path}: {rel} is missing")
            if sha256(p) != digest:
                raise BundleError(f"bundle {self.path}: {rel} does not match its sha256 in "
                                  f"{MANIFEST} (modified after export?)")
        extra = sorted(p.relative_to(self.path).as_posix() for p in self.path.rglob("*")
                       if (p.is_file() or p.is_symlink()) and p.name != MANIFEST
                       and p.relative_to(self.path).as_posix() not in files)
        if extra:
            raise BundleError(f"bundle {self.path}: {extra} are not listed in {MANIFEST} "
                              "(added or edited after export?); refusing the bundle")
        for need in (MODEL_FILES.get(m.get("format"), "?"), "pipeline/pipeline.json"):
            if need not in files:
                raise BundleError(f"bundle {self.path}: {MANIFEST} does not list {need}")

    def pipeline(self):  # type: ignore[no-untyped-def]
        from sampan.data.pipeline import FeaturePipeline

        if self._pipeline is None:
            self._pipeline = FeaturePipeline.load(self.file("pipeline"))
        return self._pipeline

    def session(self, threads: int | None = None) -> _Session:
        """The model runtime (``threads``: ONNX Runtime intra-op threads; its default when
        None). Opened once."""
        if self._session is None:
            fmt = self.manifest["format"]
            if fmt not in MODEL_FILES:
                raise BundleError(f"bundle {self.path}: unknown format {fmt!r}; expected one "
                                  f"of {list(MODEL_FILES)}")
            self._session = _Session(self.file(MODEL_FILES[fmt]), fmt, self.schema, threads)
        return self._session


def session_options(threads: int | None = None, spin: bool = True) -> Any:
    """ONNX Runtime options (no CPU memory arena): ``threads`` intra-op threads (its
    default when None); with ``spin=False`` idle worker threads sleep instead of spinning
    (for a session beside the main one, such as the user tower, whose spinning would take
    the cores the ranking model and the HTTP threads need)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    # no memory arena: its blocks, grown by one large request, were never given back (a
    # 10,000-record request left 100 MB more resident); small requests run as fast
    opts.enable_cpu_mem_arena = False
    if threads:
        opts.intra_op_num_threads = threads
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


class _Session:
    """ONNX Runtime (or TorchScript) behind one call: tensors or arrays in, ``[B, T]`` out."""

    def __init__(self, path: Path, fmt: str, schema: Any, threads: int | None = None):
        self.names = input_names(schema)
        self.fmt = fmt
        if fmt == "onnx":
            import onnxruntime as ort

            self.ort = ort.InferenceSession(str(path), session_options(threads),
                                            providers=["CPUExecutionProvider"])
        else:  # only a TorchScript bundle needs torch in the serving process
            import torch

            self.torch = torch
            self.ts = torch.jit.load(str(path)).eval()

    def run(self, inputs: tuple[Any, ...]) -> np.ndarray:
        arrays = [x if isinstance(x, np.ndarray) else
                  x.numpy() if hasattr(x, "numpy") else np.asarray(x) for x in inputs]
        if self.fmt == "onnx":
            return self.ort.run(None, dict(zip(self.names, arrays, strict=True)))[0]
        torch = self.torch
        with torch.no_grad():
            return self.ts(*[torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]).numpy()
