"""The tensor tables of docs/tensors.md list exactly the tensors ensemble/tensors.py defines (the
configs' source), with their types and shapes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ensemble.tensor_tables import BEGIN, END, MEANING, TABLES, render
from ensemble.tensors import ENSEMBLE, TENSORRT_LLM

PAGE = Path(__file__).resolve().parents[2] / "docs" / "tensors.md"
FIX = "run: python -m ensemble.tensor_tables --write docs/tensors.md"


def readme_tables() -> dict[str, list[tuple[str, str, str]]]:
    """Title -> (name, type, shape) rows, read from the page's block."""
    text = PAGE.read_text()
    block = text[text.index(BEGIN) : text.index(END)]
    tables = {}
    for title, body in re.findall(r"\*\*(.+?)\*\*\n\n((?:\|.*\n)+)", block):
        rows = [line.split("|")[1:4] for line in body.splitlines()[2:]]
        tables[title] = [(n.strip().strip("`"), t.strip(), s.strip()) for n, t, s in rows]
    return tables


def test_readme_block_is_the_rendered_one():
    assert render() in PAGE.read_text(), f"docs/tensors.md tensor tables are stale; {FIX}"


def test_readme_lists_exactly_the_defined_tensors():
    tables = readme_tables()
    assert list(tables) == [title for title, _ in TABLES]
    for title, tensors in TABLES:
        expected = [(t.name, t.dtype, "[" + ", ".join(map(str, t.dims)) + "]") for t in tensors]
        assert tables[title] == expected, f"{title} differs from ensemble/tensors.py; {FIX}"


def test_the_tables_cover_the_models_the_clients_call():
    assert [tensors for _, tensors in TABLES] == [
        ENSEMBLE.inputs,
        ENSEMBLE.outputs,
        TENSORRT_LLM.inputs,
        TENSORRT_LLM.outputs,
    ]


def test_every_meaning_belongs_to_a_tensor():
    names = {t.name for _, tensors in TABLES for t in tensors}
    assert set(MEANING) == names, f"stale: {set(MEANING) - names}, missing: {names - set(MEANING)}"


def test_write_replaces_only_the_block(tmp_path):
    page = tmp_path / "tensors.md"
    page.write_text(f"# Title\n\nbefore\n\n{BEGIN}\n\n| old | table |\n\n{END}\n\nafter\n")
    subprocess.run(
        [sys.executable, "-m", "ensemble.tensor_tables", "--write", str(page)],
        check=True,
        timeout=60,
    )
    assert page.read_text() == f"# Title\n\nbefore\n\n{render()}\n\nafter\n"
