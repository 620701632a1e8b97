"""One error base: every error meant for a user is a SampanError, the CLI turns exactly those
into one-line messages, and anything else keeps its traceback."""

from __future__ import annotations

import ast
import inspect

import pytest
from typer.testing import CliRunner

import sampan.errors as errors
from sampan.cli import app
from tests.conftest import ROOT


def test_every_error_class_derives_from_sampan_error():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if c.__module__ == errors.__name__]
    assert len(classes) >= 10
    for c in classes:
        assert issubclass(c, errors.SampanError), c


def test_the_builtin_bases_a_caller_would_catch():
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.MissingPathError, FileNotFoundError)
    assert issubclass(errors.ExistingPathError, FileExistsError)
    e = errors.UnknownModelError("unknown model 'deepfn'; did you mean 'deepfm'?")
    assert isinstance(e, KeyError)
    assert str(e) == "unknown model 'deepfn'; did you mean 'deepfm'?"  # not KeyError's repr


def test_where_the_old_names_still_import_from():
    from sampan.config import ConfigError
    from sampan.data.sources import DataError
    from sampan.models.registry import UnknownModelError
    from sampan.serving.predictor import RequestError

    assert (ConfigError, DataError, UnknownModelError, RequestError) == (
        errors.ConfigError, errors.DataError, errors.UnknownModelError, errors.RequestError)


def test_unknown_model_is_a_sampan_error():
    from sampan.models import get_model_class

    with pytest.raises(errors.SampanError, match="deepfm"):
        get_model_class("deepfn")


def test_the_cli_has_one_handler_and_no_builtin_catches():
    """No command catches ValueError, KeyError, RuntimeError or an OSError itself: those
    would turn a bug into a one-line message."""
    caught = set()
    nodes = [n for f in sorted((ROOT / "sampan" / "cli").glob("*.py"))
             for n in ast.walk(ast.parse(f.read_text()))]
    assert len(nodes) > 1000  # every command module was read
    for node in nodes:
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            caught |= {t.id for t in types if isinstance(t, ast.Name)}
    # ChildFailedError: `train --nproc-per-node` ends in one line after the processes'
    # own errors, which they printed themselves
    assert caught <= {"SampanError", "OSError", "KeyboardInterrupt", "ChildFailedError"}, caught


@pytest.mark.parametrize("raised,code,shown", [
    (errors.DataError("data.csv: no such column 'clicks'"), 2,
     "error: data.csv: no such column 'clicks'"),
    (errors.MissingPathError("runs/x is not a run directory"), 2,
     "error: runs/x is not a run directory"),
])
def test_a_sampan_error_is_one_line_and_exit_code_2(monkeypatch, tmp_path, raised, code, shown):
    def boom(*a, **k):
        raise raised

    monkeypatch.setattr("sampan.data.inspect.inspect_file", boom)
    r = CliRunner().invoke(app, ["data", "inspect", str(tmp_path / "f.csv")])
    assert r.exit_code == code
    assert shown in " ".join(r.output.split())
    assert "Traceback" not in r.output


def test_anything_else_is_a_bug_and_keeps_its_traceback(monkeypatch, tmp_path):
    def boom(*a, **k):
        raise ValueError("a bug in the code, not the user's input")

    monkeypatch.setattr("sampan.data.inspect.inspect_file", boom)
    r = CliRunner().invoke(app, ["data", "inspect", str(tmp_path / "f.csv")])
    assert isinstance(r.exception, ValueError)  # propagated, not turned into "error: ..."
    assert r.exit_code == 1
    assert "error:" not in r.output


@pytest.mark.parametrize("module, lib, extra", [("sampan.report", "matplotlib", "report"),
                                                ("sampan.tune.study", "optuna", "tune")])
def test_a_missing_extra_is_named_not_a_traceback(monkeypatch, module, lib, extra):
    """Without matplotlib, sampan report says which extra brings it (a SampanError: the CLI
    prints it as one line); so does sampan tune without Optuna."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, lib, None)  # import fails as if not installed
    load = getattr(importlib.import_module(module), "_plt" if lib == "matplotlib" else "_optuna")
    with pytest.raises(errors.MissingExtraError, match=rf"pip install 'sampan\[{extra}\]'"):
        load()
    assert issubclass(errors.MissingExtraError, ImportError)


def test_an_error_the_cli_prints_keeps_its_brackets(capsys):
    """The CLI prints errors through Rich, whose markup took "[ray]" for a tag and printed
    pip install 'sampan' as the install command."""
    import typer

    from sampan.cli.base import err, fail

    width = err.width
    err.width = 300
    try:
        with pytest.raises(typer.Exit):
            fail("data.engine: ray needs Ray: pip install 'sampan[ray]' (or [bold]x[/])")
    finally:
        err.width = width
    printed = capsys.readouterr().err
    assert "pip install 'sampan[ray]' (or [bold]x[/])" in printed, printed
