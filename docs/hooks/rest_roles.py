"""mkdocs hook: the docstrings' Sphinx roles (``:class:`~bagua_x.core.Bucket```) rendered as code.

The docstrings are read by Sphinx-minded tools and by people in an editor, where
the roles say what a name is; mkdocstrings renders Google-style docstrings as
markdown, which leaves the role as text before the code (``:class:Bucket``).
This strips the role and, as Sphinx does for a leading ``~``, keeps the last
component of the dotted path.
"""

import re

_ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc|obj):<code>(~?)([^<]*)</code>")


def _code(match: re.Match) -> str:
    tilde, path = match.groups()
    return f"<code>{path.rsplit('.', 1)[-1] if tilde else path}</code>"


def on_page_content(html: str, **_) -> str:
    return _ROLE.sub(_code, html)
