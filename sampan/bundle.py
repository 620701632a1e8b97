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

What the checksums protect against, and what they do not: they catch accidental damage (a
flipped bit, a truncated or partial copy, a file edited or replaced without the manifest
being digested again). They are not a signature: anyone who can write the bundle can edit
the manifest or a file and recompute the sha256s with :func:`manifest_digest` (the format
is public), and the bundle then opens. Against that deliberate edit a bundle is **signed**:
with a secret key (:func:`bundle_key`: ``SAMPAN_BUNDLE_KEY``, or a file named by
``SAMPAN_BUNDLE_KEY_FILE`` or ``--key-file``) the export writes ``signature``, an
HMAC-SHA256 of ``manifest_sha256`` (the digest of the whole manifest, which lists every
file's sha256, so the signature covers every file), and opening a bundle with a key refuses
one that is unsigned or whose signature does not verify with that key. A process whose
environment holds a key checks every bundle it opens (the server's bundles, reloads, the
retrieval bundle, the arms of an experiment, watched versions).

The graph takes *transformed* tensors; raw records become tensors in the predictor through
the same :class:`~sampan.data.pipeline.FeaturePipeline` code that prepared the training data,
so training and serving cannot disagree on a feature.

This module imports no torch: a server for an ONNX bundle runs without it (the writer is
:mod:`sampan.export.bundle`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sampan.errors import BundleError, ConfigError

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
    """sha256 of the manifest's canonical JSON without its own ``manifest_sha256`` and
    ``signature``."""
    body = {k: v for k, v in manifest.items() if k not in ("manifest_sha256", "signature")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


# signing ------------------------------------------------------------------------------
KEY_ENV = "SAMPAN_BUNDLE_KEY"
KEY_FILE_ENV = "SAMPAN_BUNDLE_KEY_FILE"
# set beside KEY_FILE_ENV by `sampan serve --key-file` for its own processes (its workers
# open bundles too): messages then name the option the user gave, not the variable
KEY_FILE_FROM_OPTION_ENV = "SAMPAN_BUNDLE_KEY_FILE_FROM_OPTION"
SIGNATURE_ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 16
# what is signed: this prefix and manifest_sha256 (the prefix keeps a bundle signature from
# being taken for any other HMAC made with the same key)
_SIGNED_PREFIX = b"sampan bundle manifest v1\n"


@dataclass(frozen=True)
class BundleKey:
    """The secret that signs and verifies bundles, and where it came from (for messages;
    the secret itself is never printed)."""

    secret: bytes = field(repr=False)
    source: str = "a key given in Python"

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_KEY_BYTES:
            raise ConfigError(
                f"the bundle key from {self.source} is {len(self.secret)} bytes; use at least "
                f"{MIN_KEY_BYTES} random bytes, e.g. `python -c 'import secrets; "
                "print(secrets.token_hex(32))'`")

    def sign(self, digest: str) -> str:
        """The hex HMAC-SHA256 of a manifest's ``manifest_sha256``."""
        return hmac.new(self.secret, _SIGNED_PREFIX + digest.encode("ascii"),
                        hashlib.sha256).hexdigest()


def bundle_key(key_file: str | Path | None = None) -> BundleKey | None:
    """The bundle key: the contents of ``key_file`` (``--key-file``), or of the file
    ``$SAMPAN_BUNDLE_KEY_FILE`` names, or ``$SAMPAN_BUNDLE_KEY`` itself; None when none is
    given (bundles are then checked for accidental damage only). Surrounding whitespace (a
    file's trailing newline) is not part of the key. Giving it two ways, an empty key, a
    key shorter than 16 bytes or a key file that cannot be read is a
    :class:`~sampan.errors.ConfigError` (never a silent fall-back to unsigned)."""
    given = [(name, value) for name, value in (
        ("--key-file", key_file), (KEY_FILE_ENV, os.environ.get(KEY_FILE_ENV)),
        (KEY_ENV, os.environ.get(KEY_ENV))) if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ConfigError(f"the bundle key is given {len(given)} ways "
                          f"({', '.join(n for n, _ in given)}); give exactly one")
    name, value = given[0]
    if name == KEY_ENV:
        secret, source = str(value).strip().encode(), KEY_ENV
    else:
        path = Path(value)
        via = "--key-file" if os.environ.get(KEY_FILE_FROM_OPTION_ENV) == str(value) else name
        source = f"key file {path}" + (f" ({KEY_FILE_ENV})" if via == KEY_FILE_ENV else "")
        try:
            secret = path.read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"cannot read the bundle {source}: {e.strerror or e}") from None
    if not secret:
        raise ConfigError(f"the bundle key from {source} is empty; set a key, or unset it to "
                          "check bundles for accidental damage only")
    return BundleKey(secret, source)


def as_key(key: BundleKey | bytes | str | None) -> BundleKey | None:
    """``key`` as a :class:`BundleKey`; None: the environment's (:func:`bundle_key`)."""
    if key is None:
        return bundle_key()
    if isinstance(key, BundleKey):
        return key
    return BundleKey(key.encode() if isinstance(key, str) else bytes(key))


def sign_manifest(manifest: dict[str, Any], key: BundleKey | bytes | str) -> dict[str, Any]:
    """Set ``manifest_sha256`` and, signed with ``key``, ``signature`` (in place)."""
    if key is None:
        raise ValueError("sign_manifest needs a key")
    key = as_key(key)
    manifest.pop("signature", None)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    manifest["signature"] = {"algorithm": SIGNATURE_ALGORITHM,
                             "value": key.sign(manifest["manifest_sha256"])}
    return manifest


def verification_note(key: BundleKey | None) -> str:
    """One line for a server's start: how the bundles it opens are checked."""
    if key is not None:
        return (f"bundles: signature required (HMAC-SHA256, key from {key.source}); an "
                "unsigned bundle, or one whose signature does not verify, is refused")
    return (f"bundles: checksums only (accidental damage, not a deliberate edit); set "
            f"{KEY_ENV} or --key-file to serve only bundles signed with that key")


def input_names(schema: Any) -> list[str]:
    """The graph's inputs, in order: ``dense``, ``sparse``, then one per sequence."""
    return ["dense", "sparse", *[s.name for s in schema.sequences]]


class Bundle:
    """An exported bundle opened for scoring: its manifest, pipeline and model runtime."""

    def __init__(self, path: str | Path, verify: bool = True,
                 manifest: dict[str, Any] | None = None,
                 key: BundleKey | bytes | str | None = None):
        """``key``: the bundle must be signed with it (see the module docstring); None: the
        environment's key (:func:`bundle_key`), when one is set."""
        self.path = Path(path)
        self.signature_verified = False  # True once verify() has checked the signature
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
            self.verify(key)
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

    def verify(self, key: BundleKey | bytes | str | None = None) -> None:
        """Check the whole bundle against its manifest, and with a key (``key``, else the
        environment's) the manifest's signature (see the module docstring)."""
        key = as_key(key)
        m = self.manifest
        if m.get("manifest_sha256") != manifest_digest(m):
            raise BundleError(f"bundle {self.path}: {MANIFEST} does not match its own sha256 "
                              "(modified after export?)")
        if key is not None:
            self._verify_signature(key)
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

    def _verify_signature(self, key: BundleKey) -> None:
        sig = self.manifest.get("signature")
        if sig is None:
            raise BundleError(
                f"bundle {self.path} is not signed, and a bundle key is set ({key.source}): "
                "only bundles signed with it are opened; export the run again with the same "
                f"key ({KEY_ENV}, {KEY_FILE_ENV} or --key-file)")
        value = sig.get("value") if isinstance(sig, dict) else None
        if not isinstance(value, str) or sig.get("algorithm") != SIGNATURE_ALGORITHM:
            raise BundleError(f"bundle {self.path}: {MANIFEST} has a malformed signature "
                              f"(expected {{\"algorithm\": \"{SIGNATURE_ALGORITHM}\", "
                              "\"value\": HEX}); refusing the bundle")
        want = key.sign(self.manifest["manifest_sha256"])
        if not hmac.compare_digest(want.encode(), value.encode("utf-8", "replace")):
            raise BundleError(
                f"bundle {self.path}: its signature does not verify with the bundle key from "
                f"{key.source} (signed with another key, or {MANIFEST} was edited and its "
                "sha256 recomputed after export); refusing the bundle")
        self.signature_verified = True

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
