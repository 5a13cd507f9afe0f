"""The documentation stays short and whole, with no model: README.md and each docs/*.md within
their line budgets, every relative Markdown link resolving to a file or folder of the checkout,
and the tracked tree (outside data/) speaking about the project as it is: no working-session
numbers in its text or its paths."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200
DOC_MAX_LINES = 600
LINKING = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md",
           *sorted((ROOT / "docs").glob("*.md"))]
SESSION = r"sessions? ?[0-9]+"  # git grep -E -i: the word (or its plural), an optional space, a number
SESSION_COMPONENT = re.compile(r"session[0-9]", re.IGNORECASE)  # a path component starting so

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
# `[text](target)` and `![alt](target)` (the target's optional "title" dropped); `](` also ends
# the image inside a linked badge `[![alt](img)](link)`, so both targets are found
LINK = re.compile(r"\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def link_targets(text: str) -> list[str]:
    """The targets of a Markdown text's inline links and images, outside code blocks and code
    spans, as written (angle brackets dropped)."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    return [m.group(1).strip("<>").strip() for m in LINK.finditer(text)]


def broken_links(doc: Path) -> list[str]:
    """The relative links of `doc` whose file or folder does not exist (http(s), mailto and
    other schemes and pure #anchors are not checked; a #anchor suffix is dropped; a leading /
    is the repository root)."""
    broken = []
    for target in link_targets(doc.read_text(encoding="utf-8")):
        if not target or target.startswith("#") or SCHEME.match(target):
            continue
        path = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if not path:
            continue
        resolved = ROOT / path.lstrip("/") if path.startswith("/") else doc.parent / path
        if not resolved.exists():
            broken.append(target)
    return broken


def test_link_targets_are_found_outside_code_and_without_titles():
    text = ('See [the method](docs/METHOD.md#tau) and ![plot](a%20b.png "Plot"), [![badge](img.svg)](<x y.md>),\n'
            "[web](https://example.com) `not [a](link)`\n```\n[nor](this.md)\n```\n")
    assert link_targets(text) == ["docs/METHOD.md#tau", "a%20b.png", "img.svg", "x y.md", "https://example.com"]


def test_readme_stays_within_its_line_budget():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines, over {README_MAX_LINES}: move detail into docs/"


@pytest.mark.parametrize("doc", sorted((ROOT / "docs").glob("*.md")), ids=_name)
def test_each_doc_stays_within_its_line_budget(doc):
    n = len(doc.read_text(encoding="utf-8").splitlines())
    assert n <= DOC_MAX_LINES, f"{_name(doc)} has {n} lines, over {DOC_MAX_LINES}: split it or cut history"


@pytest.mark.parametrize("doc", LINKING, ids=_name)
def test_relative_links_resolve(doc):
    assert doc.exists(), f"{_name(doc)} is missing"
    broken = broken_links(doc)
    assert not broken, f"{_name(doc)} links to paths that do not exist: {broken}"


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def git_checkout():
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the tracked tree cannot be listed")
    top = _git("rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip(f"{ROOT} is not a git checkout: the tracked tree cannot be listed")


def test_no_working_session_numbers_in_the_tracked_text(git_checkout):
    """Comments and docs say what was measured and where the record is, not which working
    session did it (data/ keeps its provenance as it was recorded)."""
    found = _git("grep", "-n", "-I", "-i", "-E", SESSION, "--", ".", ":!data")
    assert found.returncode in (0, 1), found.stderr  # 1: no match
    assert found.stdout == "", "working-session numbers in the tracked tree:\n" + found.stdout


def test_no_tracked_path_is_named_after_a_working_session(git_checkout):
    listed = _git("ls-files", "-z")
    assert listed.returncode == 0, listed.stderr
    paths = [p for p in listed.stdout.split("\0") if p and not p.startswith("data/")]
    assert paths, "git ls-files listed nothing"
    named = [p for p in paths if any(SESSION_COMPONENT.match(part) for part in p.split("/"))]
    assert not named, f"tracked paths named after a working session: {named}"
