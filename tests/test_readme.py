"""The README's Python stays true: every ```python block runs on the CPU as pasted, each in a fresh
namespace, except blocks fenced ```python no-run (fragments that need a GPU, several processes or
an engine's tensors). The docs' Python blocks are at least valid Python."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FENCE = re.compile(r"^```(\S*)[ \t]*(.*)$")
NO_RUN = "no-run"


def python_blocks(path: Path) -> list[tuple[int, bool, str]]:
    """The ```python blocks of a Markdown file: (line of the opening fence, runnable, code)."""
    blocks = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        start, language, options = i, match[1], match[2].split()
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path.name}:{start + 1}: a code fence that is never closed")
        if language == "python":
            blocks.append((start + 1, NO_RUN not in options, "\n".join(lines[start + 1 : i]) + "\n"))
        i += 1
    return blocks


README = ROOT / "README.md"
RUNNABLE = [(line, code) for line, runnable, code in python_blocks(README) if runnable]
DOCS = [
    (f"{path.relative_to(ROOT)}:{line}", code)
    for path in sorted((ROOT / "docs").glob("*.md"))
    for line, _, code in python_blocks(path)
]


def test_the_readme_has_runnable_python() -> None:
    assert len(RUNNABLE) >= 2, "the API section's quickstart and its annotated form at least"
    api = README.read_text().split("\n## The API\n", 1)[1].split("\n## ", 1)[0]
    first = next(m for m in (FENCE.match(line) for line in api.splitlines()) if m is not None)
    assert first[1] == "python" and NO_RUN not in first[2].split(), "The API opens with a runnable quickstart"


@pytest.mark.parametrize("line, code", RUNNABLE, ids=[f"README.md:{line}" for line, _ in RUNNABLE])
def test_readme_python_block_runs_on_the_cpu(line: int, code: str, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": f"readme_{line}"})


@pytest.mark.parametrize("where, code", DOCS, ids=[where for where, _ in DOCS])
def test_docs_python_block_is_valid_python(where: str, code: str) -> None:
    compile(code, where, "exec")


def test_the_readme_explain_example_is_what_msa_explain_prints(capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """README's `$ msa explain ...` block, line for line (a README line ending in "..." is cut
    short: the output's line starts with it). A backend whose `strategy()` has nothing to say (None)
    adds no line (this session's first guard of plugin strategies printed one)."""
    from msa.cli import main

    for name in ("MSA_BACKEND", "MSA_PLUGINS", "MSA_DISABLE_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("$ msa explain "))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    capsys.readouterr()
    assert main(lines[start].split()[2:]) == 0
    printed = capsys.readouterr().out.splitlines()
    shown = lines[start + 1 : end]
    assert len(printed) == len(shown), printed
    for want, got in zip(shown, printed, strict=True):
        assert got.startswith(want[:-3]) if want.endswith("...") else got == want, (want, got)
