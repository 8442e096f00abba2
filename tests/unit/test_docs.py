"""The documentation a newcomer reads: the reference in docs/ builds with MkDocs in
strict mode (a broken link or anchor between its pages fails the build), and every
relative link in the README and the docs reaches a file of this repository."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).parent / "mkdocs"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_reference_builds_with_every_link_resolved(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "state" / "index.html").exists()


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The check above can fail: a copy of the docs with one link to a missing page."""
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(ROOT / "docs"), str(docs)], check=True)
    (docs / "index.md").write_text((docs / "index.md").read_text() + "\n[gone](gone.md)\n")
    config = (ROOT / "mkdocs.yml").read_text()
    (tmp_path / "mkdocs.yml").write_text(config)
    result = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "gone.md" in result.stderr


def test_relative_links_in_the_readme_and_docs_reach_files() -> None:
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [
        f"{doc.relative_to(ROOT)}: {target}"
        for doc in documents
        for target in LINK.findall(doc.read_text())
        if "://" not in target and not (doc.parent / target).exists()
    ]
    assert broken == []


def test_the_readme_fits_on_two_screens() -> None:
    readme = (ROOT / "README.md").read_text().splitlines()
    assert readme[0] == "# vllm-guard"
    assert any(line.startswith("make run") for line in readme[:6])
    assert any(line.startswith("make test") for line in readme[:6])
    assert len(readme) <= 120
