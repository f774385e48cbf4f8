"""The README is the front page: its relative links must reach files, and it names the commands CI runs;
no tracked text file keeps a merge conflict.

mkdocs --strict (in ``make test``) checks every link of the docs pages; the README is not one of them.
"""

import re
import subprocess
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


def test_no_file_keeps_merge_conflict_markers():
    # a conflict left in README.md once passed every other test: its code blocks are not run
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)
    hits = [f for f in tracked if f.endswith((".py", ".md", ".toml", ".yml", ".sh", "Makefile"))
            and marker.search((ROOT / f).read_text(errors="replace"))]
    assert not hits, f"merge conflict markers left in {hits}"
