"""Fuzzing the config loader: whatever a user writes in a file or a --set, loading either
gives a config or raises ConfigError (a one-line message), never anything else.

``SAMPAN_FUZZ_EXAMPLES`` raises the example count (CI runs the bounded default)."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from sampan.config import ConfigError, ExperimentConfig, load_config
from tests.fuzz import fuzz

FUZZ = fuzz()

KEYS = ["name", "seed", "output_dir", "preset", "data.format", "data.train", "data.header",
        "data.delimiter", "data.block_size", "data.split.train", "data.split.method",
        "data.split.boundaries", "data.synthetic.rows", "features.label",
        "features.categorical", "features.categorical.0.min_count", "features.numeric",
        "features.numeric_defaults", "features.lists", "model.name", "model.mlp",
        "model.embedding_dim", "model.dropout", "train.epochs", "train.batch_size",
        "train.lr", "train.embedding_l2", "train.warmup_steps", "train.eval_every_steps",
        "train.early_stopping", "train.early_stopping.metric", "train.on_divergence",
        "train.schedule", "train.device", "train.amp"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=12), st.sampled_from(["auto", "deepfm", "lr", "csv",
                                                           "cuda:3", "..", "-1", "1e309"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6)


def loads_or_config_error(**kwargs) -> None:
    try:
        cfg = load_config(**kwargs)
    except ConfigError as e:
        assert str(e).strip()
        return
    assert isinstance(cfg, ExperimentConfig)


@FUZZ
@given(key=st.one_of(st.sampled_from(KEYS), st.text(min_size=1, max_size=15)),
       value=values)
def test_any_override_loads_or_is_a_config_error(key, value):
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    loads_or_config_error(path=None, overrides=[f"{key}={text}"])


@FUZZ
@given(raw=st.dictionaries(st.sampled_from(["name", "seed", "data", "features", "model",
                                            "train", "preset", "other"]), values, max_size=4))
def test_any_mapping_loads_or_is_a_config_error(raw):
    loads_or_config_error(raw=raw)


@FUZZ
@given(text=st.text(max_size=200))
def test_any_file_text_loads_or_is_a_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    try:
        path.write_text(text, encoding="utf-8")
    except UnicodeEncodeError:  # lone surrogates cannot be written as UTF-8 text
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
    loads_or_config_error(path=path)


@pytest.mark.parametrize("override", ["train.epochs=[", "model=3", "features=[1]",
                                      "data.split=abc", "train.early_stopping.metric=auc@5"])
def test_examples_found_while_writing_the_fuzzer(override):
    with pytest.raises(ConfigError):
        load_config(None, overrides=[override])
