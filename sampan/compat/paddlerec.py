"""PaddleRec model folders as Sampan experiments.

A PaddleRec model folder holds a ``config.yaml`` (``runner:`` and ``hyper_parameters:``), a
reader module that fixes the data layout, and the model's network. :func:`convert` turns
the config into a Sampan config (a plain dict, validated by :func:`sampan.config.load_config`
like any other) and says what became of every PaddleRec key: mapped, and to what; ignored,
and why; or not supported. Nothing else in Sampan knows a run came from PaddleRec.

The reader is read as text, never imported (it imports paddle): its slot lists, field lists
and transforms give the layout. Without the reader file the module name is enough for the
readers PaddleRec ships (``criteo_reader``, ``reader``, ``criteo_lr_reader``, ``dinReader``,
``census_reader``, ``esmm_reader``).

>>> is_paddlerec({"runner": {"epochs": 1}, "hyper_parameters": {}})
True
>>> is_paddlerec({"data": {}, "model": {}})
False
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sampan.errors import ConfigError

MAPPED, IGNORED, UNSUPPORTED = "mapped", "ignored", "not supported"


def is_paddlerec(raw: Any) -> bool:
    """Whether a loaded YAML mapping is a PaddleRec config (``runner:`` and
    ``hyper_parameters:`` sections)."""
    return isinstance(raw, dict) and isinstance(raw.get("runner"), dict) \
        and isinstance(raw.get("hyper_parameters"), dict)


@dataclass
class KeyRow:
    """What became of one PaddleRec key."""

    key: str  # dotted: runner.epochs, hyper_parameters.optimizer.class
    value: Any
    status: str  # mapped | ignored | not supported
    target: str = ""  # the Sampan key(s) it set, for mapped rows
    why: str = ""


@dataclass
class Conversion:
    """A PaddleRec config as a Sampan config, and what became of each of its keys."""

    config: dict[str, Any]  # the Sampan config (raw; load_config validates it)
    rows: list[KeyRow]
    model: str  # the Sampan model
    paddle_model: str  # the PaddleRec model (folder or network class)
    layout: str  # the reader's layout
    settings: list[tuple[str, str]] = field(default_factory=list)  # Sampan keys set to
    # reproduce PaddleRec's training, with why

    @property
    def unsupported(self) -> list[KeyRow]:
        return [r for r in self.rows if r.status == UNSUPPORTED]

    def summary(self) -> str:
        counts = {s: sum(r.status == s for r in self.rows) for s in (MAPPED, IGNORED,
                                                                     UNSUPPORTED)}
        return (f"PaddleRec {self.paddle_model} ({self.layout}) as Sampan's {self.model}: "
                f"{counts[MAPPED]} keys mapped, {counts[IGNORED]} ignored, "
                f"{counts[UNSUPPORTED]} not supported")


# ------------------------------------------------------------------------------ layouts
@dataclass
class Layout:
    """A reader's data layout, as its source declares it."""

    kind: str  # slot | din | census | esmm
    reader: str
    sparse_slots: list[str] = field(default_factory=list)  # slot: label first
    dense_slots: list[str] = field(default_factory=list)
    dense_shape: list[int] = field(default_factory=list)
    dense_transform: str = "none"  # none | log1p | clip01
    fields: list[str] = field(default_factory=list)  # esmm: the field ids, in order
    max_len: int = 3  # esmm: values kept per field

    def describe(self) -> str:
        return {"slot": "slot text", "din": "DIN behaviour lines", "census": "Census CSV",
                "esmm": "Ali-CCP field:feature lines"}[self.kind] + f", {self.reader}"


CRITEO_SLOTS = ["click", *(str(i) for i in range(1, 27))]
ALI_CCP_FIELDS = ["101", "109_14", "110_14", "127_14", "150_14", "121", "122", "124", "125",
                  "126", "127", "128", "129", "205", "206", "207", "210", "216", "508", "509",
                  "702", "853", "301"]
# the readers PaddleRec ships, by module name: the layout when the file is not at hand
KNOWN_READERS: dict[str, Callable[[str], Layout]] = {
    "criteo_reader": lambda r: Layout("slot", r, CRITEO_SLOTS, ["dense_feature"], [13]),
    "reader": lambda r: Layout("slot", r, CRITEO_SLOTS, ["dense_feature"], [13]),
    "criteo_lr_reader": lambda r: Layout("slot", r, ["label", "feat_idx"], ["feat_value"], [39]),
    "dinReader": lambda r: Layout("din", r),
    "census_reader": lambda r: Layout("census", r),
    "esmm_reader": lambda r: Layout("esmm", r, fields=list(ALI_CCP_FIELDS)),
}


def _literal(source: str, name: str) -> Any:
    """The literal assigned to ``name`` in ``source`` (``self.name = ...`` too), or None."""
    m = re.search(rf"(?:self\.)?\b{name}\s*=\s*(\"[^\"\n]*\"|'[^'\n]*'|\[[^\]]*\])", source)
    if not m:
        return None
    try:
        return ast.literal_eval(m.group(1))
    except (ValueError, SyntaxError):
        return None


def read_layout(folder: Path, module: str) -> Layout:
    """The layout of reader ``module`` (``runner.train_reader_path``) in ``folder``: read
    from its source when the file is there, else known by name. An unknown reader fails,
    naming the known ones."""
    name = module.rsplit(".", 1)[-1]
    path = folder / (module.replace(".", "/") + ".py")
    if not path.is_file():
        if name in KNOWN_READERS:
            return KNOWN_READERS[name](name)
        raise ConfigError(f"runner.train_reader_path {module!r}: {path} does not exist and "
                          f"{name!r} is not a reader PaddleRec ships; known readers: "
                          f"{', '.join(KNOWN_READERS)}")
    src = path.read_text(encoding="utf-8", errors="replace")
    sparse = _literal(src, "sparse_slots")
    if isinstance(sparse, str):
        sparse = sparse.split()
    if isinstance(sparse, list) and sparse:
        dense = _literal(src, "dense_slots") or []
        shape = _literal(src, "dense_slots_shape") or [1] * len(dense)
        transform = "log1p" if re.search(r"np\.log\(\s*feasign\s*\+\s*1\s*\)", src) else \
            "clip01" if re.search(r"max\(\s*0\.0\s*,\s*min\(\s*1\.0", src) else "none"
        if len(dense) != len(shape):
            raise ConfigError(f"{path}: dense_slots {dense} and dense_slots_shape {shape} "
                              "differ in length")
        return Layout("slot", name, [str(s) for s in sparse], [str(s) for s in dense],
                      [int(s) for s in shape], transform)
    fields = _literal(src, "all_field_id")
    if isinstance(fields, list) and fields:
        m = re.search(r"hyper_parameters\.max_len\"\s*,\s*(\d+)", src)
        return Layout("esmm", name, fields=[str(f) for f in fields],
                      max_len=int(m.group(1)) if m else 3)
    if re.search(r"split\(\s*['\"];['\"]\s*\)", src) and "hist" in src:
        return Layout("din", name)
    if "label_income" in src and "label_marital" in src:
        return Layout("census", name)
    raise ConfigError(f"runner.train_reader_path {module!r}: {path} is a layout the bridge "
                      "does not know; known: slot readers (sparse_slots / dense_slots, as "
                      "criteo_reader, reader and criteo_lr_reader), dinReader, census_reader, "
                      "esmm_reader")


# ------------------------------------------------------------------------------- models
# PaddleRec's folder names and network classes -> Sampan's model
FOLDERS = {"logistic_regression": "lr", "fm": "fm", "deepfm": "deepfm", "wide_deep": "wide_deep",
           "dnn": "dnn", "dcn": "dcn", "dcn_v2": "dcn_v2", "xdeepfm": "xdeepfm", "din": "din",
           "mmoe": "mmoe", "ple": "ple", "share_bottom": "share_bottom", "esmm": "esmm"}
NETWORKS = {"LRLayer": "logistic_regression", "FMLayer": "fm", "DeepFMLayer": "deepfm",
            "WideDeepLayer": "wide_deep", "DNNLayer": "dnn", "DeepCroLayer": "dcn",
            "DCN_V2Layer": "dcn_v2", "xDeepFMLayer": "xdeepfm", "DINLayer": "din",
            "MMoELayer": "mmoe", "PLELayer": "ple", "ShareBottomLayer": "share_bottom",
            "ESMMLayer": "esmm"}
# which layouts each model reads
MODEL_LAYOUTS = {"lr": {"slot"}, "fm": {"slot"}, "deepfm": {"slot"}, "wide_deep": {"slot"},
                 "dnn": {"slot"}, "dcn": {"slot"}, "dcn_v2": {"slot"}, "xdeepfm": {"slot"},
                 "din": {"din"}, "mmoe": {"census"}, "ple": {"census"},
                 "share_bottom": {"census"}, "esmm": {"esmm"}}


def find_model(folder: Path) -> str:
    """The PaddleRec model of ``folder``: by its name, else by the network class its
    ``net.py`` defines. Fails naming the models the bridge maps."""
    if folder.name in FOLDERS:
        return folder.name
    net = folder / "net.py"
    if net.is_file():
        for cls in re.findall(r"^class\s+(\w+)", net.read_text(errors="replace"), re.M):
            if cls in NETWORKS:
                return NETWORKS[cls]
    raise ConfigError(f"{folder}: not a PaddleRec model the bridge maps (by folder name or "
                      f"the network class in net.py); known folders: {', '.join(FOLDERS)}; "
                      f"network classes: {', '.join(NETWORKS)}")


# ---------------------------------------------------------------------------- converting
class _Keys:
    """The PaddleRec config's leaf keys; each is taken once and given a row."""

    def __init__(self, raw: dict[str, Any]):
        self.values: dict[str, Any] = {}
        self.rows: dict[str, KeyRow] = {}
        for section in ("runner", "hyper_parameters"):
            self._flatten(section, raw.get(section) or {})
        for k, v in raw.items():
            if k not in ("runner", "hyper_parameters"):
                self.values[k] = v

    def _flatten(self, prefix: str, d: dict[str, Any]) -> None:
        for k, v in d.items():
            key = f"{prefix}.{k}"
            if isinstance(v, dict) and v:
                self._flatten(key, v)
            else:
                self.values[key] = v

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def has(self, key: str) -> bool:
        return key in self.values

    def mark(self, key: str, status: str, target: str = "", why: str = "") -> None:
        if key in self.values and key not in self.rows:
            self.rows[key] = KeyRow(key, self.values[key], status, target, why)

    def mapped(self, key: str, target: str, why: str = "") -> None:
        self.mark(key, MAPPED, target, why)

    def ignored(self, key: str, why: str) -> None:
        self.mark(key, IGNORED, why=why)

    def unsupported(self, key: str, why: str) -> None:
        self.mark(key, UNSUPPORTED, why=why)

    def finish(self) -> list[KeyRow]:
        for key in self.values:
            if key not in self.rows:
                self.rows[key] = KeyRow(key, self.values[key], UNSUPPORTED,
                                        why="a key the bridge does not know")
        return [self.rows[k] for k in self.values]


def load_paddlerec(path: str | Path) -> dict[str, Any]:
    """Read a PaddleRec ``config.yaml``."""
    file = Path(path)
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"PaddleRec config {str(file)!r} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: not valid YAML: {e}") from None
    if not is_paddlerec(raw):
        raise ConfigError(f"{file}: not a PaddleRec config (it needs runner: and "
                          "hyper_parameters: sections)")
    return raw


def convert(path: str | Path, raw: dict[str, Any] | None = None) -> Conversion:
    """Convert the PaddleRec config at ``path`` (already loaded as ``raw``, or read here)."""
    file = Path(path).resolve()
    raw = load_paddlerec(file) if raw is None else raw
    if not is_paddlerec(raw):
        raise ConfigError(f"{file}: not a PaddleRec config (it needs runner: and "
                          "hyper_parameters: sections)")
    folder = file.parent
    keys = _Keys(raw)
    paddle_model = find_model(folder)
    reader = keys.get("runner.train_reader_path")
    if not reader:
        raise ConfigError(f"{file}: runner.train_reader_path is missing: the bridge reads the "
                          "data layout from the reader module it names")
    layout = read_layout(folder, str(reader))
    model = FOLDERS[paddle_model]
    if layout.kind not in MODEL_LAYOUTS[model]:
        raise ConfigError(f"{file}: PaddleRec's {paddle_model} with the reader {reader!r} "
                          f"({layout.describe()}): the bridge maps {paddle_model} on "
                          f"{' or '.join(sorted(MODEL_LAYOUTS[model]))} data only")
    keys.mapped("runner.train_reader_path", "data.format, features",
                f"its layout: {layout.describe()}")
    cfg: dict[str, Any] = {"name": f"paddlerec_{folder.name}"}
    settings: list[tuple[str, str]] = []
    cfg["data"] = _data(keys, folder, layout)
    cfg["features"] = _features(keys, layout, cfg["data"], settings)
    train: dict[str, Any] = {}
    cfg["model"] = _model(keys, model, settings, train)
    cfg["train"] = _train(keys, settings, train)
    _runner_rest(keys, layout, reader)
    rows = keys.finish()
    name = "mmoe" if model == "share_bottom" else model
    return Conversion(cfg, rows, name, paddle_model, layout.describe(), settings)


def _dir(keys: _Keys, key: str, folder: Path) -> str:
    value = str(keys.get(key))
    where = (folder / value).resolve()
    keys.mapped(key, "data.train" if "train" in key else "data.test",
                f"{where} (relative to the config's folder)")
    return str(where)


def _data(keys: _Keys, folder: Path, layout: Layout) -> dict[str, Any]:
    if not keys.has("runner.train_data_dir"):
        raise ConfigError("runner.train_data_dir is missing: the bridge needs the training "
                          "data's folder")
    data: dict[str, Any] = {"train": _dir(keys, "runner.train_data_dir", folder)}
    if keys.get("runner.test_data_dir"):
        data["test"] = _dir(keys, "runner.test_data_dir", folder)
    # PaddleRec trains on every row of train_data_dir and has no validation split
    data["split"] = {"method": "sequential", "train": 1.0, "valid": 0.0, "test": 0.0}
    if layout.kind == "slot":
        data["format"] = "slot"
    elif layout.kind == "esmm":
        data.update(format="slot", delimiter=",",
                    columns=["sample_id", "click", "ctcvr", "skipped"])
    elif layout.kind == "din":
        data.update(format="csv", delimiter=";", header=False,
                    columns=["hist_item_id", "hist_cat_id", "item_id", "cat_id", "label"])
    else:  # census
        n = _census_width(keys, data["train"])
        data.update(format="csv", delimiter=",", header=False,
                    columns=["label_marital", "label_income",
                             *(f"feature_{i}" for i in range(1, n + 1))])
    return data


def _census_width(keys: _Keys, train: str) -> int:
    n = keys.get("hyper_parameters.feature_size")
    if n is not None:
        keys.mapped("hyper_parameters.feature_size", "data.columns",
                    f"the {n} numeric columns after the two labels")
        return int(n)
    files = sorted(p for p in Path(train).glob("*") if p.is_file()) if Path(train).is_dir() \
        else [Path(train)]
    for p in files:
        with p.open(encoding="utf-8", errors="replace") as f:
            line = f.readline()
        if line.strip():
            return len(line.split(",")) - 2
    raise ConfigError("hyper_parameters.feature_size is missing and the training data "
                      "is not there to count the census columns")


def _numeric(transform: str) -> dict[str, Any]:
    """``numeric_defaults`` for the dense values as the reader yields them: a missing one is
    0, and nothing is scaled beyond what the reader itself does."""
    spec: dict[str, Any] = {"fill": 0.0, "log1p": transform == "log1p", "standardize": False,
                            "buckets": 0}
    if transform == "clip01":
        spec["clip"] = [0.0, 1.0]
    return spec


def _features(keys: _Keys, layout: Layout, data: dict[str, Any],
              settings: list[tuple[str, str]]) -> dict[str, Any]:
    if layout.kind == "slot":
        label, *sparse = layout.sparse_slots
        num_field = keys.get("hyper_parameters.num_field")
        if len(sparse) == 1 and num_field:  # criteo_lr_reader: one slot, num_field values
            keys.mapped("hyper_parameters.num_field", "features",
                        f"{sparse[0]} and {layout.dense_slots[0]} each hold {num_field} "
                        "fields")
            cats = [f"{sparse[0]}_{i}" for i in range(1, int(num_field) + 1)]
        else:
            cats = list(sparse)
        dense = [d if k == 1 else f"{d}_{i}" for d, k in zip(layout.dense_slots,
                                                             layout.dense_shape, strict=True)
                 for i in range(1, k + 1)]
        _check_count(keys, "hyper_parameters.sparse_inputs_slots", 1 + len(sparse),
                     f"the label and {len(sparse)} sparse slots the reader declares")
        _check_count(keys, "hyper_parameters.dense_input_dim", len(dense),
                     "the dense values the reader declares")
        return {"label": label, "categorical": cats,
                "numeric_defaults": _numeric(layout.dense_transform), "numeric": dense}
    if layout.kind == "esmm":
        _check_count(keys, "hyper_parameters.num_field", len(layout.fields),
                     "the fields the reader declares")
        max_len = int(keys.get("hyper_parameters.max_len", layout.max_len))
        keys.mapped("hyper_parameters.max_len", "features.lists[*].max_len")
        lists = [{"name": f"field_{i}", "column": f, "kind": "bag", "max_len": max_len,
                  "keep": "first", "pooling": "sum"} for i, f in enumerate(layout.fields)]
        return {"label": ["click", "ctcvr"], "lists": lists}
    if layout.kind == "din":
        max_len = _longest_history(data["train"])
        if max_len is None:
            max_len = 50
            settings.append(("features.lists[*].max_len: 50", "the training data is not "
                             "there to measure its longest history (the reader keeps all)"))
        lists = [{"name": f"hist_{c}", "share": c, "delimiter": " ", "kind": "sequence",
                  "max_len": max_len} for c in ("item_id", "cat_id")]
        for key in ("hyper_parameters.item_count", "hyper_parameters.cat_count"):
            keys.ignored(key, "vocabularies are fitted from the data: every id seen in "
                         "training gets a row")
        return {"label": "label", "categorical": ["item_id", "cat_id"], "lists": lists}
    settings.append(("features.numeric_defaults.standardize: true", "the census columns are "
                     "raw (ages, wages in the thousands next to 0/1 flags): unscaled they blow "
                     "up the first steps' loss, which Sampan's divergence guard stops"))
    return {"label": ["label_income", "label_marital"],
            "numeric_defaults": {**_numeric("none"), "standardize": True},
            "numeric": list(data["columns"][2:])}


def _longest_history(train: str) -> int | None:
    """The longest history of the DIN files (the reader pads each batch to its longest,
    so nothing is cut); None when the data is not there."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    root = Path(train)
    files = sorted(p for p in root.glob("*") if p.is_file()) if root.is_dir() else \
        [root] if root.is_file() else []
    longest = 0
    for p in files:
        col = pacsv.read_csv(p, read_options=pacsv.ReadOptions(column_names=["h"]),
                             parse_options=pacsv.ParseOptions(delimiter="\x01",
                                                              quote_char=False),
                             convert_options=pacsv.ConvertOptions(
                                 column_types={"h": pa.string()})).column("h")
        first = pc.list_element(pc.split_pattern(col, ";", max_splits=1), 0)
        n = pc.max(pc.count_substring(pc.utf8_trim_whitespace(first), " ")).as_py()
        longest = max(longest, (n or 0) + 1)
    return longest or None


def _check_count(keys: _Keys, key: str, have: int, what: str) -> None:
    if not keys.has(key):
        return
    if int(keys.get(key)) != have:
        keys.unsupported(key, f"says {keys.get(key)}, but {what} come to {have}")
    else:
        keys.mapped(key, "features", f"checked: {what}")


def _model(keys: _Keys, model: str, settings: list[tuple[str, str]],
           train: dict[str, Any]) -> dict[str, Any]:
    h = "hyper_parameters."
    m: dict[str, Any] = {"name": "mmoe" if model == "share_bottom" else model}
    for key in (h + "sparse_feature_dim", h + "embedding_dim"):
        if keys.has(key):
            m["embedding_dim"] = int(keys.get(key))
            keys.mapped(key, "model.embedding_dim")
    keys.ignored(h + "sparse_feature_number", "vocabularies are fitted from the data: every "
                 "id seen in training gets its own row, unseen ones the OOV row")
    keys.ignored(h + "feature_number", "vocabularies are fitted from the data")
    keys.ignored(h + "distributed_embedding", "train.embedding_placement shards tables over "
                 "processes (--nproc-per-node)")
    keys.ignored(h + "is_sparse", "embedding rows always get row-sparse updates")
    keys.ignored(h + "use_sparse", "embedding rows always get row-sparse updates")
    keys.ignored(h + "use_DataLoader", "Sampan reads the data in Arrow blocks")
    if model in ("dnn", "deepfm", "wide_deep", "dcn", "dcn_v2") and keys.has(h + "fc_sizes"):
        m["mlp"] = list(keys.get(h + "fc_sizes"))
        keys.mapped(h + "fc_sizes", "model.mlp")
    if model in ("fm", "deepfm"):
        m["field_weights"] = False
        settings.append(("model.field_weights: false", "PaddleRec's FM weighs every pair of "
                         "fields 1 (Sampan's default learns a weight per pair)"))
    if model == "lr" and keys.has(h + "reg"):
        train["embedding_l1"] = float(keys.get(h + "reg"))
        keys.mapped(h + "reg", "train.embedding_l1", "PaddleRec's LR puts an L1 decay on "
                    "its id weights; Sampan takes a proximal L1 step on the rows a batch used")
    if model == "dcn":
        if keys.has(h + "cross_num"):
            m["cross_layers"] = int(keys.get(h + "cross_num"))
            keys.mapped(h + "cross_num", "model.cross_layers")
        if keys.has(h + "l2_reg_cross"):
            m["cross_l2"] = float(keys.get(h + "l2_reg_cross"))
            keys.mapped(h + "l2_reg_cross", "model.cross_l2")
    if model in ("dcn", "dcn_v2"):
        if keys.has(h + "dnn_use_bn"):
            m["batch_norm"] = bool(keys.get(h + "dnn_use_bn"))
            keys.mapped(h + "dnn_use_bn", "model.batch_norm")
        keys.ignored(h + "clip_by_norm", "PaddleRec's DCN reads it and never applies it; "
                     "train.clip_grad_norm is Sampan's gradient clipping")
    if model == "dcn_v2":
        _dcn_v2(keys, m, train)
    if model == "xdeepfm":
        if keys.has(h + "layer_sizes_dnn"):
            m["mlp"] = list(keys.get(h + "layer_sizes_dnn"))
            keys.mapped(h + "layer_sizes_dnn", "model.mlp")
        if keys.has(h + "layer_sizes_cin"):
            m["cin"] = list(keys.get(h + "layer_sizes_cin"))
            keys.mapped(h + "layer_sizes_cin", "model.cin")
        keys.ignored(h + "fc_sizes", "PaddleRec's xDeepFM reads layer_sizes_dnn instead")
    if model == "din":
        _din(keys, m, settings)
    if model in ("mmoe", "ple", "share_bottom"):
        _multitask(keys, model, m)
    if model == "esmm":
        ctr, cvr = keys.get(h + "ctr_fc_sizes"), keys.get(h + "cvr_fc_sizes")
        if ctr is not None:
            m["tower_mlp"] = list(ctr)
            keys.mapped(h + "ctr_fc_sizes", "model.tower_mlp")
        if cvr is not None and ctr is not None and list(cvr) != list(ctr):
            keys.unsupported(h + "cvr_fc_sizes", f"Sampan's ESMM towers share one shape "
                             f"(model.tower_mlp = {list(ctr)})")
        else:
            keys.mapped(h + "cvr_fc_sizes", "model.tower_mlp")
    return m


def _dcn_v2(keys: _Keys, m: dict[str, Any], train: dict[str, Any]) -> None:
    h = "hyper_parameters."
    if keys.has(h + "cross_num"):
        m["cross_layers"] = int(keys.get(h + "cross_num"))
        keys.mapped(h + "cross_num", "model.cross_layers")
    if keys.has(h + "is_Stacked"):
        m["structure"] = "stacked" if keys.get(h + "is_Stacked") else "parallel"
        keys.mapped(h + "is_Stacked", "model.structure")
    mixture = bool(keys.get(h + "use_low_rank_mixture", False))
    experts = int(keys.get(h + "num_experts", 1) or 1)
    if mixture and experts > 1:
        keys.unsupported(h + "use_low_rank_mixture", "Sampan's dcn_v2 has one low-rank cross "
                         "per layer, not a mixture of low-rank experts")
        keys.unsupported(h + "num_experts", "no mixture of low-rank experts in Sampan's dcn_v2")
    else:
        keys.mapped(h + "use_low_rank_mixture", "model.low_rank")
        keys.mapped(h + "num_experts", "model.low_rank", "one expert: a plain low-rank cross")
    if mixture and keys.has(h + "low_rank"):
        m["low_rank"] = int(keys.get(h + "low_rank"))
        keys.mapped(h + "low_rank", "model.low_rank")
    else:
        keys.ignored(h + "low_rank", "use_low_rank_mixture is off: full-rank crosses")
    if keys.has(h + "l2_reg_cross"):
        train["weight_decay"] = float(keys.get(h + "l2_reg_cross"))
        keys.mapped(h + "l2_reg_cross", "train.weight_decay", "an L2 penalty on the cross "
                    "weights; Sampan's weight decay covers every dense weight")


def _din(keys: _Keys, m: dict[str, Any], settings: list[tuple[str, str]]) -> None:
    h = "hyper_parameters."
    item, cat = keys.get(h + "item_emb_size"), keys.get(h + "cat_emb_size")
    if item is not None:
        m["embedding_dim"] = int(item)
        keys.mapped(h + "item_emb_size", "model.embedding_dim")
    if cat is not None and item is not None and int(cat) != int(item):
        keys.unsupported(h + "cat_emb_size", f"Sampan embeds every feature at one width "
                         f"(model.embedding_dim = {item})")
    else:
        keys.mapped(h + "cat_emb_size", "model.embedding_dim")
    act = str(keys.get(h + "act", "sigmoid"))
    if act in ("sigmoid", "relu", "prelu", "dice"):
        m["activation"] = m["attention_activation"] = act
        keys.mapped(h + "act", "model.activation, model.attention_activation")
    else:
        keys.unsupported(h + "act", f"activation {act!r}; Sampan's DIN has sigmoid, relu, "
                         "prelu and dice")
    m.update(history="hist_item_id", target="item_id", attention_mlp=[80, 40], mlp=[80, 40],
             input_norm=False)
    settings.append(("model.attention_mlp: [80, 40], model.mlp: [80, 40], input_norm: "
                     "false", "the layer sizes PaddleRec's DIN builds in, without batch norm"))


def _multitask(keys: _Keys, model: str, m: dict[str, Any]) -> None:
    h = "hyper_parameters."
    for key in (h + "gate_num", h + "task_num"):
        _check_count(keys, key, 2, "the census reader's labels (income, marital)")
    if keys.has(h + "tower_size"):
        m["tower_mlp"] = [int(keys.get(h + "tower_size"))]
        keys.mapped(h + "tower_size", "model.tower_mlp")
    if model == "share_bottom":
        m["experts"] = 1
        if keys.has(h + "bottom_size"):
            m["expert_mlp"] = [int(keys.get(h + "bottom_size"))]
            keys.mapped(h + "bottom_size", "model.expert_mlp", "one expert: MMoE with a "
                        "single expert is the shared-bottom model")
        return
    if keys.has(h + "expert_size"):
        m["expert_mlp"] = [int(keys.get(h + "expert_size"))]
        keys.mapped(h + "expert_size", "model.expert_mlp")
    if model == "mmoe" and keys.has(h + "expert_num"):
        m["experts"] = int(keys.get(h + "expert_num"))
        keys.mapped(h + "expert_num", "model.experts")
    if model == "ple":
        for key, target in (("shared_num", "shared_experts"), ("exp_per_task", "task_experts"),
                            ("level_number", "levels")):
            if keys.has(h + key):
                m[target] = int(keys.get(h + key))
                keys.mapped(h + key, f"model.{target}")


OPTIMIZERS = {"adam": ("adam", "adam"), "sgd": ("sgd", "sgd"), "adagrad": ("adam", "adagrad"),
              "adamw": ("adamw", "adam")}


def _train(keys: _Keys, settings: list[tuple[str, str]], t: dict[str, Any]) -> dict[str, Any]:
    r, h = "runner.", "hyper_parameters."
    for key, target in (("train_batch_size", "batch_size"), ("epochs", "epochs"),
                        ("infer_batch_size", "eval_batch_size"),
                        ("print_interval", "log_every_steps")):
        if keys.has(r + key):
            t[target] = int(keys.get(r + key))
            keys.mapped(r + key, f"train.{target}")
    name = str(keys.get(h + "optimizer.class", "adam")).lower()
    if name not in OPTIMIZERS:
        keys.unsupported(h + "optimizer.class", f"optimizer {name!r}; the bridge maps "
                         f"{', '.join(OPTIMIZERS)}")
    else:
        t["optimizer"], t["sparse_optimizer"] = OPTIMIZERS[name]
        if name == "sgd":
            t["momentum"] = 0.0
        keys.mapped(h + "optimizer.class", "train.optimizer, train.sparse_optimizer"
                    + (", train.momentum: 0" if name == "sgd" else ""))
    for key in ("optimizer.learning_rate", "optimizer.learning_rate_base_lr"):
        if keys.has(h + key):
            t["lr"] = float(keys.get(h + key))
            keys.mapped(h + key, "train.lr")
    keys.ignored(h + "optimizer.strategy", "a parameter-server setting: Sampan trains "
                 "data-parallel (--nproc-per-node)")
    t.update(schedule="constant", warmup_steps=0, first_order_warm_start=False,
             embedding_l2=0.0, early_stopping={"enabled": False})
    settings += [
        ("train.schedule: constant, warmup_steps: 0", "PaddleRec trains at a constant rate"),
        ("train.embedding_l2: 0", "PaddleRec adds no L2 unless the config asks for one"),
        ("train.first_order_warm_start: false, early_stopping.enabled: false",
         "PaddleRec trains every epoch from its initial weights, with no validation split"),
    ]
    return t


def _runner_rest(keys: _Keys, layout: Layout, reader: Any) -> None:
    r = "runner."
    infer = keys.get(r + "infer_reader_path")
    if infer is not None and str(infer) != str(reader):
        keys.unsupported(r + "infer_reader_path", f"{infer!r} differs from train_reader_path "
                         f"{reader!r}: Sampan reads test data in the training layout")
    else:
        keys.mapped(r + "infer_reader_path", "data.test", "the training layout")
    why = {
        "use_gpu": "train.device: auto trains on a GPU when there is one (set train.device)",
        "use_xpu": "Sampan trains on CPU or CUDA (train.device)",
        "use_auc": "AUC is always reported, per label",
        "auc_num": "AUC is always reported, per label",
        "model_save_path": "checkpoints go to the run directory (--run-dir)",
        "infer_load_path": "sampan eval RUN_DIR evaluates the run's model",
        "infer_start_epoch": "the test split is scored once, with the final weights",
        "infer_end_epoch": "the test split is scored once, with the final weights",
        "use_inference": "sampan export RUN_DIR writes the model and its feature pipeline to "
                         "ONNX",
        "save_inference_feed_varnames": "an exported bundle takes raw columns by name",
        "save_inference_fetch_varnames": "an exported bundle returns a probability per label",
        "use_fleet": "--nproc-per-node launches data-parallel training",
        "sync_mode": "data-parallel training is synchronous",
        "thread_num": "train.threads sets the CPU threads",
        "num_workers": "Sampan parses the data in Arrow, not in loader workers",
        "split_file_list": "every file of the data folder is read",
        "reader_type": "Sampan reads every layout the same way",
        "pipe_command": "Sampan reads the data files directly",
    }
    for key, text in why.items():
        keys.ignored(r + key, text)


def write_yaml(conv: Conversion, source: Path) -> str:
    """The converted config as commented YAML."""
    head = [f"# Converted from the PaddleRec config {source}", f"# {conv.summary()}",
            "#   sampan convert paddlerec " + str(source) + " prints what became of each key."]
    if conv.unsupported:
        head.append("# Not supported: " + ", ".join(r.key for r in conv.unsupported))
    body = yaml.safe_dump(conv.config, sort_keys=False, width=100, default_flow_style=None)
    return "\n".join(head) + "\n" + body
