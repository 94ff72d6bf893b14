"""docs/README.md indexes every page of docs/, one line each, and the README links it; the
relative links of the index and of the pages issue 39 added resolve (issue 39, item 12)."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
INDEX = os.path.join(DOCS, "README.md")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def relative_links(path):
    """(target file, line) of every relative link in a markdown file (anchors dropped)."""
    out = []
    for n, line in enumerate(read(path).splitlines(), 1):
        for target in LINK.findall(line):
            if "://" in target or target.startswith(("#", "mailto:")):
                continue
            out.append((os.path.normpath(os.path.join(os.path.dirname(path), target.split("#")[0])), n))
    return out


def test_the_index_links_every_docs_page_once():
    pages = {os.path.normpath(p) for p in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)}
    pages.discard(os.path.normpath(INDEX))
    linked = [t for t, _ in relative_links(INDEX)]
    missing = sorted(os.path.relpath(p, DOCS) for p in pages - set(linked))
    assert not missing, f"docs/README.md does not list {missing}"
    rows = [ln for ln in read(INDEX).splitlines() if ln.startswith("| [")]
    per_page = [os.path.normpath(os.path.join(DOCS, LINK.findall(r)[0])) for r in rows]
    assert sorted(per_page) == sorted(set(per_page)), "a page is listed twice"
    for r in rows:
        assert len([c for c in r.strip().strip("|").split("|") if c.strip()]) >= 2, f"no description: {r}"


def test_the_readme_links_the_index():
    assert "(docs/README.md)" in read(os.path.join(ROOT, "README.md"))


@pytest.mark.parametrize("page", ["README.md", "gpu.md", "memory.md", "choosing_kl.md", "peer_names.md",
                                  "tasks.md", "scale.md", os.path.join("dev", "gpu_kit.md")])
def test_relative_links_resolve(page):
    broken = [f"{page}:{n}: {os.path.relpath(t, ROOT)}" for t, n in relative_links(os.path.join(DOCS, page))
              if not os.path.exists(t)]
    assert not broken, broken
