"""Every ```python block of README.md and docs/*.md runs as written.

A block that cannot run on this machine says so right above it with
``<!-- snippet: needs <what> -->`` and is skipped with that reason; an unmarked block
must run (a fresh namespace, a temporary working directory).  So the docs cannot
drift from the code without a failing test.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- snippet: (?P<needs>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def snippets():
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code")) + 1
            out.append(pytest.param(m.group("code"), m.group("needs"), id=f"{doc.name}:{line}"))
    return out


SNIPPETS = snippets()


def test_the_docs_have_runnable_snippets():
    runnable = [p for p in SNIPPETS if p.values[1] is None]
    assert len(SNIPPETS) >= 12 and len(runnable) >= 4, (len(SNIPPETS), len(runnable))


@pytest.mark.parametrize("code,needs", SNIPPETS)
def test_snippet_runs(code, needs, tmp_path, monkeypatch):
    if needs == "needs cuda" and torch.cuda.is_available():
        needs = None  # a GPU machine runs the CUDA snippets (with names they define themselves or below)
    if needs is not None and needs.startswith("needs the privacy extra") and importlib.util.find_spec("dp_accounting"):
        needs = None  # the test extra brings dp-accounting: where it is installed, the snippet runs
    if needs is not None:
        pytest.skip(f"the docs mark this snippet: {needs}")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})
