"""Every shell command a user copies from README.md and docs/*.md runs as written.

The ```bash blocks are read as a user pastes them: backslash continuations joined,
comments dropped, a ``for`` loop run for its first values (``$seed`` -> ``0``).  Each
``fedopt ...`` command runs for real, in-process (``fedopt_kernels.cli.main``), in a
fresh folder holding the files the docs define (a ```toml block whose first line is
``# NAME.toml``), and must exit 0.  Long runs are shortened the documented way:
``FEDOPT_MAX_ROUNDS=1 FEDOPT_MAX_LOCAL_STEPS=2`` (docs/development.md) cap every run at
one round of two local steps, with a note.

A block that cannot run here says so right above it, with its reason,
``<!-- commands: not run here: <why> -->``, and is skipped with that reason (as the
Python snippets' ``<!-- snippet: needs ... -->``, tests/test_readme_snippets.py); an
unmarked block whose commands are not ``fedopt`` commands fails, asking for the mark.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- commands: (?P<skip>[^>]*?) -->\n)?```(?:bash|sh|shell)\n(?P<code>.*?)```", re.S)
FILE = re.compile(r"```toml\n# (?P<name>[\w.-]+\.toml)\n(?P<text>.*?)```", re.S)
LOOP = re.compile(r"for (\w+) in ([^;]+); do")

pytestmark = pytest.mark.slow


def commands(code: str) -> list:
    """The commands of a block as a user's shell runs them, loops at their first values."""
    values, out = {}, []
    for line in code.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        for var, items in LOOP.findall(line):
            values[var] = items.split()[0]
        line = LOOP.sub("", line).strip()
        if line in ("", "done", "done; done"):
            continue
        for var, value in values.items():
            line = line.replace(f"${var}", value)
        out.append(line)
    return out


def blocks():
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code")) + 1
            out.append(pytest.param(commands(m.group("code")), m.group("skip"), id=f"{doc.name}:{line}"))
    return out


def doc_files() -> dict:
    return {m.group("name"): m.group("text") for doc in DOCS for m in FILE.finditer(doc.read_text())}


BLOCKS = blocks()


def test_the_docs_have_runnable_commands():
    runnable = [p for p in BLOCKS if p.values[1] is None]
    assert len(runnable) >= 8, [p.id for p in runnable]
    assert sum(len(p.values[0]) for p in runnable) >= 20


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cmds,skip", BLOCKS)
def test_commands_run(cmds, skip, tmp_path, monkeypatch, capsys, restore_threads):
    if skip is not None:
        pytest.skip(f"the docs mark this block: {skip}")
    from fedopt_kernels.cli import main

    not_fedopt = [c for c in cmds if not c.startswith("fedopt ")]
    assert not not_fedopt, (f"{not_fedopt}: not a fedopt command; mark the block "
                            "<!-- commands: not run here: <why> --> if it cannot run in a test")
    for name, text in doc_files().items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDOPT_MAX_ROUNDS", "1")
    monkeypatch.setenv("FEDOPT_MAX_LOCAL_STEPS", "2")
    for cmd in cmds:
        code = main(shlex.split(cmd)[1:])
        err = capsys.readouterr().err
        assert code == 0, f"{cmd!r} exited {code}: {err[-2000:]}"
