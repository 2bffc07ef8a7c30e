"""The docs site's structure: every public name has a reference entry, every guide is in the navigation."""

from __future__ import annotations

import re
from pathlib import Path

import rlightning_comm

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DIRECTIVE = re.compile(r"^::: (rlightning_comm(?:\.\w+)*)$", re.M)


def _directives() -> set[str]:
    return {m.group(1) for page in (DOCS / "reference").glob("*.md") for m in DIRECTIVE.finditer(page.read_text())}


def test_every_public_name_is_in_the_api_reference():
    directives = _directives()
    missing = []
    for name in rlightning_comm.__all__:
        obj = getattr(rlightning_comm, name)
        home = getattr(obj, "__module__", None) or obj.__name__  # a module's own name
        covered = f"rlightning_comm.{name}" in directives or any(
            home == d or home.startswith(d + ".") for d in directives if d.count(".") >= 1 and d != "rlightning_comm"
        )
        if not covered:
            missing.append(f"{name} (defined in {home})")
    assert not missing, f"public names with no '::: ...' entry under docs/reference/: {missing}"


def test_every_reference_directive_names_something_that_exists():
    from test_exports import _resolves

    for target in sorted(_directives()):
        assert _resolves(target), f"docs/reference names {target}, which does not exist"


def test_every_page_is_in_the_navigation_and_every_nav_entry_exists():
    nav = set(re.findall(r"([\w/-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == nav, f"only in docs/: {sorted(pages - nav)}; only in mkdocs.yml: {sorted(nav - pages)}"


def test_benchmarks_is_a_short_report_with_a_command_per_section():
    text = (ROOT / "BENCHMARKS.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 350, f"BENCHMARKS.md has {len(lines)} lines; it is the current report, at most 350"
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    no_command = [s.splitlines()[0] for s in sections if not re.search(r"^    \S", s, re.M) and "GPU" not in s[:10]]
    assert not no_command, f"sections of BENCHMARKS.md without the command that measures them: {no_command}"
    assert not re.search(r"\bissue \d+|#\d+\b", text), "BENCHMARKS.md cites the tracker"
