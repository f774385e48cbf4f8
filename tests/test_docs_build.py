"""`make docs` (part of `make test`) must be able to fail: mkdocs --strict on a copy of the site with one
broken link added exits non-zero and names the link; the Makefile does not silence the warnings strict mode
counts (``--quiet`` hides them, and the build then passes whatever they say)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MKDOCS = Path(sys.executable).parent / "mkdocs"


def _build(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([str(MKDOCS), "build", "--strict", "-d", str(root / "site")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=240)


def _site_copy(tmp_path: Path) -> Path:
    """The docs and their config copied; what they include (the package, examples, tests) linked."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    for entry in ROOT.iterdir():
        if entry.name not in ("docs", "mkdocs.yml", "build", ".git", ".venv"):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


@pytest.mark.skipif(not MKDOCS.exists(), reason="mkdocs is not installed (the docs extra)")
def test_a_broken_link_fails_the_strict_build(tmp_path):
    root = _site_copy(tmp_path)
    clean = _build(root)
    assert clean.returncode == 0, clean.stderr[-2000:]
    pages = list((root / "site").rglob("*.html"))
    assert len(pages) > 10
    raw = {str(p.relative_to(root)): m for p in pages
           if (m := re.findall(r":(?:class|meth|func|attr|mod|exc):<code>[^<]*", p.read_text()))}
    assert not raw, f"Sphinx roles left as text on the site: {raw}"  # docs/hooks/rest_roles.py renders them
    with open(root / "docs" / "index.md", "a") as f:
        f.write("\nSee [the missing page](no-such-page.md).\n")
    broken = _build(root)
    assert broken.returncode != 0, "mkdocs --strict accepted a link to a page that does not exist"
    assert "no-such-page.md" in broken.stderr


def test_the_makefile_keeps_the_warnings_strict_mode_counts():
    docs_lines = [line for line in (ROOT / "Makefile").read_text().splitlines() if "mkdocs build" in line]
    assert docs_lines, "the Makefile no longer builds the docs"
    assert all("--strict" in line and "--quiet" not in line and " -q" not in line for line in docs_lines), docs_lines
