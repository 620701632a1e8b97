"""The layer order of docs/architecture.md, checked from every module's imports (ast): no
upward import and no cycle between layers, except the known ones the page lists."""

from __future__ import annotations

import ast
import re
from collections import defaultdict

from tests.conftest import ROOT

SAMPAN = ROOT / "sampan"
# upward imports that docs/architecture.md names as still to be removed (issue 15)
KNOWN: set[tuple[str, str]] = set()


def layers() -> list[set[str]]:
    """The ```layers block of docs/architecture.md, top to bottom."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S).group(1)
    return [set(line.split()) for line in block.strip().splitlines()]


def unit(module: str) -> str:
    """``sampan.train.trainer`` -> ``train``; ``sampan.batch`` -> ``batch``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "sampan"


def modules() -> dict[str, object]:
    out = {}
    for path in SAMPAN.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports() -> list[tuple[str, str, int]]:
    """``(importer, imported sampan module, line)`` for every import, lazy ones included."""
    mods = modules()
    found = []
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                           else node.module for a in node.names]
            for t in targets:
                if t == "sampan" or t.startswith("sampan."):
                    while t not in mods and "." in t:
                        t = t.rsplit(".", 1)[0]
                    found.append((name, t, node.lineno))
    return found


def test_every_package_has_a_layer():
    named = set().union(*layers())
    units = {unit(m) for m in modules()} - {"sampan", "__main__"}
    assert units <= named, f"not in docs/architecture.md's layers: {sorted(units - named)}"
    assert len(named) == sum(len(x) for x in layers()), "a name is in two layers"


def upward(edges: list[tuple[str, str, int]]) -> dict[tuple[str, str], list[str]]:
    """The imports from a layer to a higher one, by (importer's layer, imported layer). The
    namespace root (``sampan``: the version, the lazy API alias) and ``__main__`` are not
    layers."""
    rank = {u: i for i, layer in enumerate(layers()) for u in layer}
    out = defaultdict(list)
    for src, dst, line in edges:
        a, b = unit(src), unit(dst)
        if {a, b} & {"sampan", "__main__"} or a == b:
            continue
        if rank[b] < rank[a]:  # a lower index is a higher layer
            out[(a, b)].append(f"{src}:{line} imports {dst}")
    return dict(out)


def cycle(edges: list[tuple[str, str, int]], skip: set[tuple[str, str]]) -> list[str] | None:
    """A cycle between layers (``[a, b, ..., a]``), ignoring the edges in ``skip``."""
    graph = defaultdict(set)
    for src, dst, _ in edges:
        a, b = unit(src), unit(dst)
        if a != b and not {a, b} & {"sampan", "__main__"} and (a, b) not in skip:
            graph[a].add(b)
    state: dict[str, int] = {}

    def visit(u: str, path: list[str]) -> list[str] | None:
        state[u] = 1
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return [*path, u, v]
            if v not in state and (found := visit(v, [*path, u])):
                return found
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u, [])):
            return found
    return None


def test_no_upward_import_and_no_cycle():
    edges = imports()
    up = upward(edges)
    unexpected = {k: v for k, v in up.items() if k not in KNOWN}
    assert not unexpected, "upward imports:\n" + "\n".join(
        line for v in unexpected.values() for line in v)
    gone = KNOWN - set(up)
    assert not gone, f"no longer imported upward (take them off KNOWN and the page): {gone}"
    assert cycle(edges, KNOWN) is None, f"import cycle: {cycle(edges, KNOWN)}"


def test_the_checks_can_fail():
    edges = [("sampan.schema", "sampan.train.trainer", 3), ("sampan.train.trainer",
                                                             "sampan.schema", 9)]
    assert upward(edges) == {("schema", "train"):
                             ["sampan.schema:3 imports sampan.train.trainer"]}
    assert cycle(edges, set()) in (["schema", "train", "schema"], ["train", "schema", "train"])
    assert cycle(edges, {("schema", "train")}) is None
