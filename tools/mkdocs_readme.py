"""MkDocs hook: the README as the site's "Guide" page (``guide.md``), one source for both.

The README's links are written for GitHub (``docs/FORMAT.md``, ``notebooks/x.ipynb``); on the
site, ``docs/`` links point to the pages themselves and links to other repository files become
their paths in code (they are not part of the site)."""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File

_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def _site_link(match: re.Match, docs: set[str]) -> str:
    bang, text, target = match.groups()
    if re.match(r"[a-z]+://|#|mailto:", target):
        return match.group(0)
    path, _, anchor = target.partition("#")
    if path.startswith("docs/") and path[len("docs/") :] in docs:
        return f"{bang}[{text}]({path[len('docs/') :]}{'#' + anchor if anchor else ''})"
    return f"`{path}`" if not text or text == path else f"{text} (`{path}`)"


def on_files(files, config):
    """Adds ``guide.md``: the README with its links made site links."""
    readme = os.path.join(os.path.dirname(config.config_file_path), "README.md")
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    docs = {f.src_uri for f in files}
    content = _LINK.sub(lambda m: _site_link(m, docs), text)
    files.append(File.generated(config, "guide.md", content=content))
    return files
