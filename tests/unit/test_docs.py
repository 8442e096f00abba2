"""The documentation a newcomer reads: the reference in docs/ builds with MkDocs in
strict mode (a broken link or anchor between its pages fails the build), and every
relative link in the README and the docs reaches a file of this repository."""

from __future__ import annotations

import json
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


#: What an operator reads first: the README, deploy/README.md and the reference.
DOCUMENTS = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted(ROOT.glob("docs/*.md"))]
ANCHORED = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")
#: A section named in prose: (BENCHMARKS.md, "On a GPU"), README, "Deploy on Kubernetes".
SECTION = re.compile(r"\b([\w./-]*(?:README|\.md)),? \"([^\"]+)\"")
#: A path in backquotes: `deploy/k8s/base`, `../Dockerfile`, `guard/loop.py`.
PATH = re.compile(r"`((?:\.\.?/)?[\w.-]+(?:/[\w.*-]+)*/?)`")
#: Backquoted paths that are not this repository's: vLLM's image and source, and
#: what ``make docs`` builds.
NOT_OURS = ("vllm/", "site/")


def headings(document: Path) -> list[str]:
    """The document's headings (outside code blocks), as written."""
    found, fenced = [], False
    for line in document.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.append(line.lstrip("#").strip())
    return found


def slug(heading: str) -> str:
    """The anchor GitHub (and MkDocs' toc) gives a heading."""
    text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_relative_links_in_the_readme_and_docs_reach_files() -> None:
    broken = [
        f"{doc.relative_to(ROOT)}: {target}"
        for doc in DOCUMENTS
        for target in LINK.findall(doc.read_text())
        if "://" not in target and not (doc.parent / target).exists()
    ]
    assert broken == []


def test_anchors_and_named_sections_are_headings_of_their_documents() -> None:
    """``README.md#anchor`` links reach a heading, and a section named in prose
    (``README, "The fixed backend"``) is the start of one: text moved between the
    README and docs/ left such pointers behind."""
    broken = []
    for doc in DOCUMENTS:
        text = doc.read_text()
        for target, anchor in ANCHORED.findall(text):
            linked = (doc.parent / target) if target else doc
            if "://" in target or not linked.exists():
                continue  # a page elsewhere, or a missing file (the test above)
            if anchor not in [slug(h) for h in headings(linked)]:
                broken.append(f"{doc.relative_to(ROOT)}: {target}#{anchor}")
        for name, section in SECTION.findall(text):
            named = name if name.endswith(".md") else f"{name}.md"
            candidates = [doc.parent / named, ROOT / named]
            found = next((c for c in candidates if c.exists()), None)
            titles = headings(found) if found else []
            if not any(t.lower().startswith(section.lower()) for t in titles):
                broken.append(f'{doc.relative_to(ROOT)}: {name}, "{section}"')
    assert broken == []


def test_paths_named_in_the_readme_and_docs_exist() -> None:
    """A path in backquotes names a file or folder of this repository: relative to
    the document, the repository, or the package (``guard/loop.py``)."""
    bases = [ROOT, ROOT / "gateway", ROOT / "deploy" / "vllm-fixed"]
    missing = [
        f"{doc.relative_to(ROOT)}: {path}"
        for doc in DOCUMENTS
        for path in PATH.findall(doc.read_text())
        if "/" in path.strip("/")
        and not path.startswith(NOT_OURS)
        and not any((base / path).exists() for base in [doc.parent, *bases])
    ]
    assert missing == []


def test_the_readme_fits_on_two_screens() -> None:
    readme = (ROOT / "README.md").read_text().splitlines()
    assert readme[0] == "# vllm-guard"
    assert any(line.startswith("make run") for line in readme[:6])
    assert any(line.startswith("make test") for line in readme[:6])
    assert len(readme) <= 120


def metrics_tables() -> tuple[dict[str, list[str]], dict[str, list[float]]]:
    """docs/metrics.md's tables: each metric's labels, and each histogram's buckets."""
    labels: dict[str, list[str]] = {}
    buckets: dict[str, list[float]] = {}
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) < 2:
            continue
        names = re.findall(r"`([a-z_:*]+)`", cells[0])
        if cells[1].startswith("`le`"):  # the buckets table: `le` | bounds
            bounds = [float(b) for b in re.sub(r"\(.*\)", "", cells[2]).split(",")]
            buckets.update({name: bounds for name in names})
        else:
            labels.update({name: [x.strip() for x in cells[1].split(",") if x.strip()]
                           for name in names})  # fmt: skip
    return labels, buckets


def test_the_metrics_table_is_what_the_gateway_exports() -> None:
    """Every series the gateway's registry holds is in docs/metrics.md with the labels
    it has (a counter under its ``_total`` name), every documented series exists, and
    every histogram's buckets are the documented ones. Read from the registry, so a
    metric or a label added later fails here until the table says so."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase

    from gateway.observe.metrics import Histogram, Metrics

    metrics = Metrics(CollectorRegistry(), models=["m"], backends=["b"])
    wrappers = {m._name: m for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)}
    exported: dict[str, list[str]] = {}
    exported_buckets: dict[str, list[float]] = {}
    for family in metrics.registry.collect():
        if family.name.startswith("process_"):
            exported["process_*"] = []
            continue
        metric = wrappers[family.name]  # every family is one of Metrics' own
        name = f"{family.name}_total" if family.type == "counter" else family.name
        exported[name] = list(metric._labelnames)
        if isinstance(metric, Histogram):
            exported_buckets[name] = [b for b in metric._upper_bounds if b != float("inf")]
    documented, documented_buckets = metrics_tables()
    problems = {
        "exported, not documented": sorted(set(exported) - set(documented)),
        "documented, not exported": sorted(set(documented) - set(exported)),
        "labels (documented, exported)": {
            name: (documented[name], labels)
            for name, labels in exported.items()
            if name in documented and documented[name] != labels
        },
        "buckets differ": sorted(
            name
            for name in {*exported_buckets, *documented_buckets}
            if documented_buckets.get(name) != exported_buckets.get(name)
        ),
    }
    assert {k: v for k, v in problems.items() if v} == {}


def test_the_docs_and_the_dashboard_call_the_real_release_policy_the_default() -> None:
    """The default release policy changed (adaptive, then auto): no page calls another
    policy the default, and the time-to-first-token panel and the performance page
    name the one the gateway runs."""
    from gateway.config import ReleasePolicy, StreamSettings

    default = StreamSettings().release.value
    others = "|".join(p.value for p in ReleasePolicy if p.value != default)
    stale = re.compile(
        rf"\b(?:{others})`?\s+default\b|\bdefault(?:s to| is|:)?\s+`?(?:release: )?(?:{others})\b"
    )
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "vllm-guard-overview.json").read_text())
    descriptions = {p["title"]: p.get("description", "") for p in dashboard["panels"]}
    texts = {str(doc.relative_to(ROOT)): doc.read_text() for doc in DOCUMENTS}
    texts.update({f"panel {title!r}": text for title, text in descriptions.items()})
    wrong = [f"{where}: {m[0]}" for where, text in texts.items() for m in stale.finditer(text)]
    assert wrong == []
    (ttft,) = [text for title, text in descriptions.items() if "first token" in title.lower()]
    assert f"release: {default}" in ttft
    assert f"release: {default}" in texts["docs/performance.md"]


def test_the_readme_says_make_demo_needs_a_checkout() -> None:
    """``make demo`` starts vLLM with the test-only poisoning scheduler from the
    checkout's tests/support, which the package does not install: where the README
    introduces it, it says so."""
    from gateway.tools.localvllm import REPO, SUPPORT_FILES

    support = "tests/support"
    assert all((REPO / support / name).exists() for name in SUPPORT_FILES)
    readme = (ROOT / "README.md").read_text()
    before = readme[: readme.index("make demo  ")].rsplit("```", 1)[0]
    introduction = before.strip().rsplit("\n\n", 1)[-1]  # the paragraph above its block
    assert "checkout" in introduction
    assert f"`{support}`" in introduction
