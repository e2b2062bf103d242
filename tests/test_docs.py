"""The documentation stays true to the tree: README.md (the short user guide) and the pages under docs/.

`make docs` (MkDocs, strict) checks the links between the pages; these tests check what MkDocs cannot
see: that the files and folders the pages name exist, that the layout page names every module of the
library and every benchmark script, that the README stays short and links only to existing files, and
that every measured table sits under the bench script that produces it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 400

# a backticked token that names a file or folder: `a/b.py`, `b.py`, `families/`
PATH_TOKEN = re.compile(r"`([\w.-]+(?:/[\w.-]+)*(?:/|\.(?:py|yaml|jinja|sh|md|toml|txt|lock|cfg)))`")
# folders of the repository whose paths the pages name; generated ones (assets/, outputs/,
# checkpoints/, bench/results/) are not in the tree and are left out
TRACKED_ROOTS = (
    "mmrl/",
    "bench/",
    "scripts/",
    "examples/",
    "reward_functions/",
    "format_prompts/",
    "tests/",
    "docs/",
)
GENERATED = ("bench/results/",)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _table_rows(text: str) -> list[list[str]]:
    """The body rows of every Markdown table in ``text``, as lists of cell texts."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [row for row in rows if row[0] not in ("folder", "target", "page", "command")]


def _layout_paths() -> list[str]:
    """Every path the layout page names: each row's folder, and the names in its second column inside it."""
    paths = []
    for folder_cell, *rest in _table_rows((DOCS / "layout.md").read_text()):
        folder = folder_cell.strip("`")
        assert folder.endswith("/"), (
            f"docs/layout.md: a row's first column is a folder ending in /, got {folder_cell!r}"
        )
        paths.append(folder)
        for cell in rest:
            paths += [folder + name for name in PATH_TOKEN.findall(cell)]
    return paths


def test_every_path_the_layout_page_names_exists():
    missing = [p for p in _layout_paths() if not (ROOT / p).exists()]
    assert not missing, f"docs/layout.md names paths that do not exist (remove or fix them): {missing}"


def test_the_layout_page_names_every_module_and_bench_script():
    named = set(_layout_paths())
    modules = [
        p for p in (ROOT / "mmrl").rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts
    ]
    packages = [p.parent for p in (ROOT / "mmrl").rglob("__init__.py") if "__pycache__" not in p.parts]
    wanted = [p.relative_to(ROOT).as_posix() for p in modules]
    wanted += [p.relative_to(ROOT).as_posix() + "/" for p in packages]
    wanted += [p.relative_to(ROOT).as_posix() for p in (ROOT / "bench").glob("*.py")]
    absent = sorted(set(wanted) - named)
    assert len(wanted) > 100  # the walk found the library
    assert not absent, f"docs/layout.md does not name {absent}: add each to its folder's row"


def test_paths_named_in_the_pages_exist():
    """Every backticked path under a tracked folder, on every page and in the README, is in the tree."""
    missing = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for token in PATH_TOKEN.findall(page.read_text()):
            if (
                token.startswith(TRACKED_ROOTS)
                and not token.startswith(GENERATED)
                and not (ROOT / token).exists()
            ):
                missing.append(f"{page.relative_to(ROOT)}: {token}")
    assert not missing, "pages name files that do not exist:\n" + "\n".join(missing)


def test_the_readme_is_short_and_links_only_to_existing_files():
    text = README.read_text()
    n_lines = len(text.splitlines())
    assert n_lines <= README_MAX_LINES, (
        f"README.md has {n_lines} lines (at most {README_MAX_LINES}): reference material goes to docs/"
    )
    targets = [t.split("#")[0] for t in LINK.findall(text) if not t.startswith(("http://", "https://", "#"))]
    assert "docs/index.md" in targets  # the way into the reference pages
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_states_the_test_command():
    """CI runs "the README's test command" (.ci/run); the README says which it is."""
    text = README.read_text()
    assert "make test" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "make docs" in ci


def test_measured_tables_sit_under_the_bench_script_that_produces_them():
    """docs/benchmarks.md: one section per bench script, named in its heading, and every script exists."""
    text = (DOCS / "benchmarks.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) >= 10
    for section in sections:
        heading = section.splitlines()[0]
        scripts = re.findall(r"`(bench/[\w]+\.py)`", heading)
        assert scripts, f"docs/benchmarks.md: section {heading!r} names no bench script in its heading"
        for script in scripts:
            assert (ROOT / script).is_file(), (
                f"docs/benchmarks.md: {script} (section {heading!r}) does not exist"
            )


def test_every_page_is_in_the_nav():
    """mkdocs.yml's nav lists every page once (MkDocs' strict build fails on the rest too)."""
    nav = re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert sorted(nav) == sorted(p.name for p in DOCS.glob("*.md"))
