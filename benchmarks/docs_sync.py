"""Keep the docs true to the benchmarks: a section of README.md or docs/*.md written as

    <!-- results: technique_table.txt -->
    ```text
    (benchmarks/results/technique_table.txt, verbatim)
    ```
    <!-- /results -->

holds that results file as the benchmark last wrote it. Every benchmark calls `sync()` after writing its
results; `python benchmarks/docs_sync.py` does it by hand; tests/test_docs.py fails when a section and its
file disagree.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTION = re.compile(r"(<!-- results: (?P<name>[\w.]+) -->\n```text\n)(?P<body>.*?)(```\n<!-- /results -->)", re.S)


def sections(text: str) -> list[tuple[str, str]]:
    """(results file name, the section's text) for every results section of a page."""
    return [(m.group("name"), m.group("body")) for m in SECTION.finditer(text)]


def results_text(name: str) -> str:
    text = (RESULTS / name).read_text()
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def sync() -> list[str]:
    """Rewrite every results section of the pages from benchmarks/results/; the pages changed."""
    changed = []
    for page in PAGES:
        text = page.read_text()
        new = SECTION.sub(lambda m: m.group(1) + results_text(m.group("name")) + m.group(4), text)
        if new != text:
            page.write_text(new)
            changed.append(str(page.relative_to(ROOT)))
    return changed


if __name__ == "__main__":
    print("\n".join(sync()) or "docs already match benchmarks/results")
