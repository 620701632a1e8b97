"""MkDocs hooks of the documentation site (mkdocs.yml: hooks)."""

from __future__ import annotations

import re
from typing import Any

# the docstrings' Sphinx roles (:meth:`run`, :class:`~a.b.C`) as mkdocstrings leaves them
_ROLE = re.compile(r":(?:meth|class|func|mod|attr|exc|data|obj):<code>~?([^<]*)</code>")


def on_page_content(html: str, **_: Any) -> str:
    """Roles in rendered docstrings become plain code: the name, its path's last part for
    a ``~`` reference."""
    return _ROLE.sub(lambda m: f"<code>{m.group(1)}</code>" if "~" not in m.group(0)
                     else f"<code>{m.group(1).rsplit('.', 1)[-1]}</code>", html)
