"""The README is the front page: its relative links must reach files, and it names the commands CI runs.

mkdocs --strict (in ``make test``) checks every link of the docs pages; the README is not one of them.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_relative_links_reach_files():
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", README) if "://" not in t]
    assert len(targets) >= 10, targets  # the docs pages and examples are linked
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_names_the_make_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
    for command in ("make test", "make demo", "make check"):
        assert f"{command} " in README, command
