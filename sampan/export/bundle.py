"""Writing bundles: what ``sampan export RUN_DIR --out BUNDLE`` writes. The layout and the
checks a bundle passes when it is opened are described in :mod:`sampan.bundle`, the reader;
the export is checked against PyTorch on the run's own rows before anything is written.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import platform
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sampan.bundle import (  # noqa: F401  (Bundle and the digests: importable from here too)
    FORMAT_VERSION,
    MANIFEST,
    MODEL_FILES,
    Bundle,
    BundleKey,
    as_key,
    manifest_digest,
    sha256,
    sign_manifest,
)
from sampan.data.pipeline import PIPELINE_FILE
from sampan.embedding.collection import EmbeddingCollection
from sampan.errors import BundleError, ConfigError, ExistingPathError, ExportError


def _versions() -> dict[str, str]:
    import sampan

    out = {"sampan": sampan.__version__, "torch": torch.__version__,
           "python": platform.python_version(), "numpy": np.__version__}
    for mod in ("onnx", "onnxruntime", "pyarrow"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return out


def export_run(run_dir: str | Path, out: str | Path, fmt: str = "onnx",
               parity_rows: int = 256, overwrite: bool = False,
               feature_tables: bool = True,
               key: BundleKey | bytes | str | None = None) -> Path:
    """Write the bundle of a finished run (best weights) to ``out`` and return its path.

    With a bundle key (``key``, else the environment's: ``SAMPAN_BUNDLE_KEY`` or
    ``SAMPAN_BUNDLE_KEY_FILE``, see :func:`sampan.bundle.bundle_key`) the manifest is signed,
    so that a server holding the same key serves it and refuses it once edited.

    With ``feature_tables`` the run's data files are read again for the item and user
    tables the server joins to requests (:mod:`sampan.export.tables`).

    After writing, the graph is run on up to ``parity_rows`` rows of the run's test (or
    valid, or train) split and compared with PyTorch eager; the largest absolute difference
    is recorded in the manifest, and an export that disagrees by more than 1e-4 fails.
    """
    from sampan.data.loader import BatchLoader
    from sampan.train.experiment import RunArtifacts

    if fmt not in MODEL_FILES:
        raise ConfigError(f"unknown export format {fmt!r}; expected one of {list(MODEL_FILES)}")
    key = as_key(key)  # a bad key setting fails before anything is exported
    out = Path(out)
    if out.exists():
        if not overwrite:
            raise ExistingPathError(f"{out} exists; choose a new --out or pass --overwrite")
        if not (out / MANIFEST).exists():
            raise ExistingPathError(f"{out} exists and is not a Sampan bundle; not touching it")
    art = RunArtifacts(run_dir)
    model = art.model.eval().cpu()
    schema = art.store.schema
    split = next(s for s in ("test", "valid", "train") if art.store.split(s) is not None)
    data = art.store.split(split)
    example = next(iter(BatchLoader(data.take(np.arange(min(parity_rows, len(data)))),
                                    batch_size=parity_rows, shuffle="none", prefetch=0)))
    example, frozen = _freeze_dynamic(model, example)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_bundle(art, model, schema, example, split, fmt, run_dir, tmp, frozen,
                      feature_tables, key)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise BundleError(f"no space left on the device while writing the bundle to "
                              f"{out} ({e.strerror}); nothing was written") from e
        raise
    if out.exists():  # --overwrite: the old bundle goes only once the new one is whole
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
    return out


def _freeze_dynamic(model: Any, example: Any) -> tuple[Any, dict[str, Any]]:
    """A model with dynamic tables is exported taking rows, not keys: each table's key ->
    row map is frozen (to go into the bundle's feature pipeline, which then maps raw values
    to rows), the graph's collections stop mapping, and the parity rows are mapped once
    here. Returns the mapped example and the maps by feature."""
    frozen: dict[str, Any] = {}
    example = _keys_to_rows(model, example)
    for c in _dynamic_collections(model):
        frozen.update(c.frozen_maps())
        c.keys_are_rows = True
    return example, frozen


def _dynamic_collections(model: Any) -> list[EmbeddingCollection]:
    return [m for m in model.modules() if isinstance(m, EmbeddingCollection) and m.dynamic]


def _keys_to_rows(model: Any, batch: Any) -> Any:
    """``batch`` with the keys of ``model``'s dynamic tables replaced by their rows, as the
    bundle's pipeline gives them (read-only: nothing is admitted)."""
    sparse, seqs = batch.sparse, batch.sequences
    for c in _dynamic_collections(model):
        with torch.no_grad():
            sparse, seqs = c.eval().rows_of_keys(sparse, seqs)
    return dataclasses.replace(batch, sparse=sparse, sequences=seqs)


def _write_frozen_maps(frozen: dict[str, Any], pipeline_dir: Path) -> None:
    """Each dynamic feature's frozen map as ``dynamic_<name>.keys.npy`` / ``.rows.npy``,
    named in the pipeline state, so the served pipeline maps its keys to rows."""
    state_path = pipeline_dir / PIPELINE_FILE
    state = json.loads(state_path.read_text())
    own = [e["vocab"] for e in state["lists"] if e.get("vocab") is not None]  # own tables
    for entry in [*state["categorical"], *own]:
        name = entry["spec"]["name"]
        if name in frozen:
            keys, rows = frozen[name]
            np.save(pipeline_dir / f"dynamic_{name}.keys.npy", keys.numpy(), allow_pickle=False)
            np.save(pipeline_dir / f"dynamic_{name}.rows.npy", rows.numpy(), allow_pickle=False)
            entry["frozen_map"] = f"dynamic_{name}"
    state_path.write_text(json.dumps(state, indent=1))


def _write_bundle(art: Any, model: Any, schema: Any, example: Any, split: str, fmt: str,
                  run_dir: str | Path, tmp: Path, frozen: dict[str, Any],
                  feature_tables: bool, key: BundleKey | None = None) -> None:
    from sampan.export import graph
    from sampan.export.tables import write_feature_tables

    model_path = tmp / MODEL_FILES[fmt]
    with torch.no_grad():
        if fmt == "onnx":
            graph.to_onnx(model, schema, example, model_path)
        else:
            graph.to_torchscript(model, schema, example, model_path)
        want = graph.ScoringGraph(model, schema).eval()(*graph.example_inputs(example, schema))
    shutil.copytree(art.run / "data" / "pipeline", tmp / "pipeline")
    if frozen:
        _write_frozen_maps(frozen, tmp / "pipeline")
    tables = write_feature_tables(art, model, schema, tmp) if feature_tables else {
        "skipped": "exported without feature tables"}
    retrieval = None
    if getattr(model, "task", "binary") in ("retrieval", "next_item"):
        retrieval = _export_retrieval(art, model, schema, example, tmp)

    bundle = Bundle(tmp, verify=False, manifest={"format": fmt, "schema": schema.to_json()})
    got = bundle.session().run(graph.example_inputs(example, schema))
    diff = float(np.abs(got - want.numpy()).max()) if len(got) else 0.0
    if not diff <= 1e-4:
        raise ExportError(f"exported graph disagrees with PyTorch by {diff:.3g} on {split} rows")

    results = art.run / "results.json"
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {
        "format_version": FORMAT_VERSION,
        "format": fmt,
        "model_file": MODEL_FILES[fmt],
        "model": art.cfg.model.name,
        "task": getattr(model, "task", "binary"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "run_dir": str(Path(run_dir).resolve()),
        "inputs": [{"name": "dense", "dtype": "float32", "shape": ["batch", schema.num_dense]},
                   {"name": "sparse", "dtype": "int64", "shape": ["batch", schema.num_sparse]}]
        + [{"name": s.name, "dtype": "int64", "shape": ["batch", s.max_len]}
           for s in schema.sequences],
        "outputs": [{"name": "probabilities", "dtype": "float32",
                     "shape": ["batch", schema.num_tasks], "labels": schema.labels}],
        "schema": schema.to_json(),
        "config": json.loads(json.dumps(art.cfg.model_dump(mode="json"))),
        "metrics": json.loads(results.read_text()) if results.exists() else None,
        "parity": {"rows": int(example.size), "split": split, "max_abs_diff": diff},
        "retrieval": retrieval,
        "feature_tables": tables,
        "versions": _versions(),
        "files": {p.relative_to(tmp).as_posix(): sha256(p) for p in files},
    }
    if key is not None:  # manifest_sha256, and its HMAC
        sign_manifest(manifest, key)
    else:
        manifest["manifest_sha256"] = manifest_digest(manifest)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _export_retrieval(art: Any, model: Any, schema: Any, example: Any,
                      out: Path) -> dict[str, Any]:
    """For a two-tower or next-item run: the user tower (a next-item model's state after
    the history) as ``user_tower.onnx``, the vectors of every item it ranks in a faiss
    index, and the items' raw values in ``items.parquet`` (row ``i`` of the index is item
    ``i``). A two-tower model ranks the items of the train split (the corpus evaluation
    ranks), a next-item model every item of its table."""
    import faiss
    import onnxruntime as ort
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sampan.data.transforms import FIRST_VOCAB_ID
    from sampan.export import graph

    graph.to_onnx(model, schema, example, out / "user_tower.onnx", head="user_vectors")
    inputs = graph.example_inputs(example, schema)
    sess = ort.InferenceSession(str(out / "user_tower.onnx"),
                                providers=["CPUExecutionProvider"])
    got = sess.run(None, dict(zip(graph.input_names(schema), [x.numpy() for x in inputs],
                                  strict=True)))[0]
    with torch.no_grad():
        want = graph.ScoringGraph(model, schema, "user_vectors").eval()(*inputs).numpy()
    diff = float(np.abs(got - want).max()) if len(got) else 0.0
    if not diff <= 1e-4:
        raise ExportError(f"exported user tower disagrees with PyTorch by {diff:.3g}")
    ids, vectors, item_feature = _corpus(art, model, schema)
    enc = next(e for e in art.pipeline.categorical if e.spec.name == item_feature)
    named = ids < FIRST_VOCAB_ID + len(enc.vocab_)  # hashed OOV buckets have no raw value
    vectors = np.ascontiguousarray(vectors[named], dtype=np.float32)
    ids = ids[named]
    raw = enc.vocab_.take(pa.array(ids - FIRST_VOCAB_ID))
    dim = vectors.shape[1]
    if len(vectors) <= 200_000:  # exact search is fast enough and has no recall loss
        index, kind = faiss.IndexFlatIP(dim), "flat_ip"
    else:
        index, kind = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT), "hnsw32_ip"
    index.add(vectors)
    faiss.write_index(index, str(out / "items.faiss"))
    pq.write_table(pa.table({"item": raw, "id": pa.array(ids)}),
                   out / "items.parquet")
    info = {"user_tower": "user_tower.onnx", "user_tower_max_abs_diff": diff,
            "index": "items.faiss", "index_kind": kind,
            "items": "items.parquet", "count": int(len(vectors)), "dim": int(dim),
            "item_column": enc.spec.column or enc.spec.name, "item_feature": item_feature}
    if getattr(model, "task", "binary") == "next_item":
        return {**info, "item_features": [item_feature, *model.item_features],
                "history": model.history,
                "exclude_history": bool(model.exclude_history)}
    return {**info, "item_features": list(model.item_feature_names)}


def _corpus(art: Any, model: Any, schema: Any) -> tuple[np.ndarray, np.ndarray, str]:
    """The ids of the items a retrieval model ranks, their vectors (on the CPU in fp32,
    like the exported user tower) and the item feature's name."""
    from sampan.data.loader import BatchLoader

    with torch.no_grad():
        if getattr(model, "task", "binary") == "next_item":
            ids = np.arange(2, int(model.item_cardinality))  # padding and OOV never rank
            vectors = model.item_vectors(torch.from_numpy(ids)).float().numpy()
            return ids, vectors, schema.sparse[model.target_column].name
        from sampan.tasks.retrieval import RetrievalTask

        task = RetrievalTask(model, art.store.split("train"))
        # the model takes rows, so the items' dynamic keys are mapped first, as for the
        # example
        vectors = torch.cat([model.item_vectors(_keys_to_rows(model, b)) for b in BatchLoader(
            task.corpus_rows, 16384, shuffle="none", prefetch=0)]).numpy()
    return task.corpus_ids, vectors, schema.sparse[model.item_column].name
