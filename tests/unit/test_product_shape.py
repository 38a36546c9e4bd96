"""The product's shape, as a newcomer meets it: a README short enough to read (what, why, how to start, what it
wins, where things live), a results file of one entry per claim, a results folder of current runs only, and no
dangling reference between them. Not here: the flags' own agreement (the flags' tests) or import rules."""

from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
RESULTS_MD = REPO / "eval" / "RESULTS.md"
RESULTS_DIR = REPO / "eval" / "results"
MAX_README_LINES, MAX_RESULTS_LINES, MAX_RESULT_FILES = 200, 250, 150

_CODE_SPAN = re.compile(r"`([^`\s]+)`")
_RESULT_FILE = re.compile(r"^(eval/results/)?[a-z0-9_{},]+/[^/]+\.(md|jsonl|json|png)$")
"""A result file as the docs cite it: `<experiment>/<file>` (in eval/RESULTS.md, relative to eval/results/) or
`eval/results/<experiment>/<file>`; braces as a shell expands them."""


def expand_braces(pattern: str) -> list[str]:
    """`a_{x,y}_b{,_c}.md` -> every combination, as a shell expands it."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def cited_result_files(text: str, relative: bool = True) -> list[str]:
    """Paths under eval/results/ (returned relative to it) that a Markdown text cites in code spans, braces
    expanded. `relative`: spans may be relative to eval/results/ (eval/RESULTS.md); otherwise only spans written
    from the repository root count."""
    cited = []
    for span in _CODE_SPAN.findall(text):
        if not _RESULT_FILE.match(span) or (not relative and not span.startswith("eval/results/")):
            continue
        cited += [path.removeprefix("eval/results/") for path in expand_braces(span)]
    return cited


def linked_docs(text: str) -> list[str]:
    """Targets of Markdown links into docs/, without their #anchor."""
    return [t.split("#")[0] for t in re.findall(r"\]\((docs/[^)\s]+)\)", text)]


def test_expand_braces():
    assert expand_braces("a_seed{0,1}.md") == ["a_seed0.md", "a_seed1.md"]
    assert expand_braces("x{,_caps}_{a,b}.md") == ["x_a.md", "x_b.md", "x_caps_a.md", "x_caps_b.md"]


def test_readme_is_short_and_names_the_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES, "README.md: long-form text belongs in docs/"
    for needed in ("make demo", "make test", "--radix-cache-backend multilora", "test_product_shape.py"):
        assert needed in text, f"README.md no longer names {needed!r}"


def test_results_md_is_short():
    assert len(RESULTS_MD.read_text().splitlines()) <= MAX_RESULTS_LINES, \
        "eval/RESULTS.md: one entry per claim; superseded runs belong in the history, not here"


def result_files() -> list[Path]:
    """The files of eval/results/ the tree holds: git's tracked files in a checkout (a report tool run locally may
    leave plots beside them), every file otherwise."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", str(RESULTS_DIR)], cwd=REPO, capture_output=True,
                             check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        out = ""
    tracked = [REPO / f for f in out.split("\0") if f]
    return tracked or [p for p in RESULTS_DIR.rglob("*") if p.is_file()]


def test_results_folder_holds_current_runs_in_one_folder_per_experiment():
    files = result_files()
    assert len(files) <= MAX_RESULT_FILES, f"eval/results/ holds {len(files)} files: prune superseded runs"
    loose = [p.name for p in files if p.parent == RESULTS_DIR]
    assert not loose, f"result files outside an experiment's folder: {loose}"


def test_every_docs_page_the_readme_links_exists():
    links = linked_docs(README.read_text())
    assert links, "README.md links no docs/ page"
    missing = [link for link in links if not (REPO / link).is_file()]
    assert not missing, f"README.md links missing pages: {missing}"


def test_every_result_file_cited_exists():
    for doc in (RESULTS_MD, README, *sorted((REPO / "docs").glob("*.md"))):
        cited = cited_result_files(doc.read_text(), relative=doc == RESULTS_MD)
        missing = sorted({c for c in cited if not (RESULTS_DIR / c).is_file()})
        assert not missing, f"{doc.relative_to(REPO)} cites result files that do not exist: {missing}"
    assert cited_result_files(RESULTS_MD.read_text()), "eval/RESULTS.md cites no result file"


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown text's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_readme_links_into_results_md_name_its_sections():
    anchors = heading_anchors(RESULTS_MD.read_text())
    links = re.findall(r"\]\(eval/RESULTS\.md#([^)\s]+)\)", README.read_text())
    assert links, "README.md's results table links no eval/RESULTS.md entry"
    assert not set(links) - anchors, f"README.md links sections eval/RESULTS.md lacks: {set(links) - anchors}"
