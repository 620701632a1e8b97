"""The REST API reference, generated from the server's OpenAPI document: every route, what
it does, its request body's fields with an example, and its responses, as Markdown
(``python -m sampan.serving.reference docs/reference/rest.md`` writes the documentation
site's page; a test checks that the page matches the code). A running server serves the
same document at ``/openapi.json`` and an interactive page at ``/docs``."""

from __future__ import annotations

import inspect
import json
import sys
from typing import Any

from sampan.config.reference import cell, write_page

COMMAND = "python -m sampan.serving.reference docs/reference/rest.md"


def openapi() -> dict[str, Any]:
    """The OpenAPI document of ``sampan serve``'s HTTP app (no model needs loading: the
    routes and their bodies do not depend on it)."""
    from sampan.serving.http import create_app

    return create_app(None).openapi()  # type: ignore[arg-type]


def _schema_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def type_of(s: dict[str, Any]) -> str:
    """A reader's name of a JSON schema: ``string``, ``array of integer``, ``RankItem``."""
    if "$ref" in s:
        return _schema_name(s["$ref"])
    if "anyOf" in s:
        return " or ".join(dict.fromkeys(type_of(a) for a in s["anyOf"]))
    if s.get("type") == "array":
        return f"array of {type_of(s.get('items', {}))}"
    if "enum" in s:
        return " or ".join(json.dumps(v) for v in s["enum"])
    return str(s.get("type", "any"))


def _fields(schema: dict[str, Any], schemas: dict[str, Any]) -> list[str]:
    required = set(schema.get("required", []))
    rows = ["| field | type | required | default | meaning |", "|---|---|---|---|---|"]
    for name, p in schema.get("properties", {}).items():
        default = json.dumps(p["default"]) if "default" in p else ""
        rows.append(f"| `{name}` | {cell(type_of(p))} | {'yes' if name in required else ''}"
                    f" | {cell(default)} | {cell(p.get('description', ''))} |")
    return rows


def _doc(text: str) -> str:
    return inspect.cleandoc(text).replace("``", "`")


def markdown() -> str:
    """The whole reference page."""
    doc = openapi()
    schemas = doc.get("components", {}).get("schemas", {})
    lines = ["# REST API reference", "",
             f"Generated from the server's OpenAPI document (`{COMMAND}`); a running "
             "`sampan serve` serves it at `/openapi.json`, and an interactive page at "
             "`/docs`. A running server's document is written for the bundles it serves: "
             "each body names the model's own features, with the JSON types the server "
             "takes (a numeric feature is a JSON number), which of them a request must "
             "give (the rest come from the feature tables and live histories), and the "
             "experiment's arms; a client generated from it sends what the model reads. "
             "Every error is a JSON body `{\"error\": ..., \"field\": ...}` naming what was "
             "wrong, a request that is not valid HTTP/1.1 included.", ""]
    body_schemas = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            lines += [f"## `{method.upper()} {path}`", ""]
            if op.get("description"):
                lines += [_doc(op["description"]), ""]
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            ref = body.get("schema", {}).get("$ref")
            if ref:
                name = _schema_name(ref)
                body_schemas.append(name)
                s = schemas[name]
                lines += [f"Request body: `{name}`.", ""] + _fields(s, schemas) + [""]
                for ex in s.get("examples", [])[:1]:
                    lines += ["```json", json.dumps(ex, indent=1), "```", ""]
            lines += ["| status | meaning | body |", "|---|---|---|"]
            for status, r in op.get("responses", {}).items():
                schema = r.get("content", {}).get("application/json", {}).get("schema", {})
                lines.append(f"| {status} | {cell(r.get('description', ''))} | "
                             f"{cell(type_of(schema)) if schema else ''} |")
            lines.append("")
    lines += ["## Response bodies", ""]
    for name, s in schemas.items():
        if name in body_schemas or name.startswith(("HTTPValidationError", "ValidationError")):
            continue
        lines += [f"### `{name}`", ""]
        if s.get("description"):
            lines += [_doc(s["description"]), ""]
        if s.get("properties"):
            lines += _fields(s, schemas) + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    write_page(sys.argv[1:], markdown())
