"""Candidate retrieval for ``/v1/recommend``: a two-tower or next-item bundle's user tower +
faiss index.

The request's context (e.g. ``{"user_id": "196"}``, with the user's attributes and live
history joined from the feature store, or the recent items themselves, e.g.
``{"hist_item_id": ["B01", "B07"]}``) goes through the retrieval bundle's own pipeline;
item-side features are left missing, since the user tower does not read them. The user
vector searches the item index by inner product (the score the model was trained on: the
scaled cosine of a two-tower model, a next-item model's logit) and returns the raw item ids
of the ``n`` best items, which the ranking model then scores. A next-item model trained with
``exclude_history`` leaves out the items of the history, as its evaluation does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from sampan.bundle import Bundle, BundleKey, session_options
from sampan.errors import BundleError
from sampan.serving.predictor import Predictor, RequestError


class Retriever:
    def __init__(self, bundle: str | Path, max_records: int = 10_000,
                 predictor: Predictor | None = None,
                 key: BundleKey | bytes | str | None = None):
        """``predictor``: the bundle's, when it is served as the ranking model too; ``key``:
        open only a bundle signed with it (None: the environment's, as :class:`Bundle`)."""
        import faiss
        import onnxruntime as ort
        import pyarrow.parquet as pq

        self.bundle = predictor.bundle if predictor is not None else Bundle(bundle, key=key)
        info = self.bundle.manifest.get("retrieval")
        if not info:
            raise BundleError(f"{bundle} is not a retrieval bundle (export a two_tower or a "
                              "next-item run: sasrec, hstu)")
        self.info = info
        if predictor is None:
            predictor = Predictor(self.bundle, max_records=max_records, json_types=True)
            predictor.name = f"retrieval model {self.bundle.manifest.get('model', '?')!r}"
        self.predictor = predictor
        # one user per call: a single thread, which does not spin (see session_options)
        self.session = ort.InferenceSession(str(self.bundle.file(info["user_tower"])),
                                            session_options(1, spin=False),
                                            providers=["CPUExecutionProvider"])
        faiss.omp_set_num_threads(1)  # one query per call: threads only add hand-offs
        self.index = faiss.read_index(str(self.bundle.file(info["index"])))
        items = pq.read_table(self.bundle.file(info["items"]))
        self.items = items.column("item").to_pylist()
        self.history = info.get("history")  # a next-item model's history feature
        self.exclude_history = bool(info.get("exclude_history"))
        self.row_of_id = {int(i): r for r, i in enumerate(items.column("id").to_pylist())}
        # raw columns the user tower does not read: sent as missing values
        feats = self.predictor.pipeline.features
        raw = {f.name: f.cross or [f.column or f.name] for f in feats.categorical}
        raw |= {f.name: f.flags or [f.column or f.name] for f in feats.lists}
        raw |= {f.name: [f.column or f.name] for f in feats.numeric}
        self.item_columns = {c for name in info["item_features"] for c in raw.get(name, [])}
        # the user tower's fitted categorical features read straight from a column: an id
        # the vocabulary lacks (OOV, id 1) is a user the model never saw
        self.user_keys = [(j, e.spec.column or e.spec.name)
                          for j, e in enumerate(self.predictor.pipeline.categorical)
                          if e.spec.name not in info["item_features"] and e.spec.vocab
                          and e.spec.dynamic is None and not e.spec.cross
                          and e.spec.bucketize == "none" and e.spec.time is None]

    def search(self, context: dict[str, Any], n: int, store: Any = None
               ) -> list[tuple[str, float]]:
        """The ``n`` best items for the user of ``context``: ``[(item, score)]``."""
        return self.search_with_notes(context, n, store)[0]

    def search_with_notes(self, context: dict[str, Any], n: int, store: Any = None
                          ) -> tuple[list[tuple[str, float]], list[str]]:
        """:meth:`search`, and a warning for each user key of ``context`` the model never
        saw in training (its candidates are then those of an unseen user)."""
        p = self.predictor
        if not isinstance(context, dict) or not context:
            raise RequestError("context must name the user (e.g. {\"user_id\": ...})",
                               "context")
        table = p.user_table(context, store, self.item_columns)
        arrays = p.pipeline.transform(table, with_labels=False)
        seqs = arrays.get("sequences") or {}
        feeds = dict(zip(["dense", "sparse", *[s.name for s in p.bundle.schema.sequences]],
                         [arrays["dense"].astype(np.float32), arrays["sparse"].astype(np.int64),
                          *[seqs[s.name].astype(np.int64) for s in p.bundle.schema.sequences]],
                         strict=True))
        u = self.session.run(None, feeds)[0].astype(np.float32)
        skip: set[int] = set()
        if self.history is not None and self.exclude_history:
            skip = {self.row_of_id[i] for i in seqs[self.history][0].tolist()
                    if i in self.row_of_id}
        scores, rows = self.index.search(np.ascontiguousarray(u),
                                         min(n + len(skip), len(self.items)))
        found = [(self.items[r], float(s)) for r, s in zip(rows[0], scores[0], strict=True)
                 if r >= 0 and r not in skip][:n]
        notes = self._history_notes(seqs) + [
            f"{column} {str(context[column])[:100]!r} is unknown to the retrieval model (not "
            "in its training data): the candidates are those of an unseen user"
            for j, column in self.user_keys
            if context.get(column) is not None and int(arrays["sparse"][0, j]) == 1]
        return found, notes

    def _history_notes(self, seqs: dict[str, np.ndarray]) -> list[str]:
        """A next-item model's history with items it never saw in training (they read as
        one unknown item), or with none it knows (its candidates are then the same for
        everyone)."""
        if self.history is None:
            return []
        ids = seqs[self.history][0]
        if not bool((ids >= 2).any()):
            return [f"the history {self.history!r} holds no item the retrieval model knows "
                    "(an unknown user, no recent items or only unseen ones): the candidates "
                    "are those of a user with no history"]
        unseen = int((ids == 1).sum())
        return [f"{unseen} item(s) of the history {self.history!r} are unknown to the "
                "retrieval model (not in its training data)"] if unseen else []
