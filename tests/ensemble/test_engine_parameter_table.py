"""The engine-parameter table of docs/configuration.md names every EngineConfig field once, with
its default (the table's words for a default that depends on the machine: "auto", "unset",
"on for CUDA")."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from backend.config import EngineConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
# How the table writes a default that is not a literal value.
WORDS = {None: ("unset", "model limit", "on for CUDA", "32 on GPU"), "auto": ("auto",)}


def table_rows() -> dict[str, str]:
    """Field name -> the default column, from the table under "## Engine parameters"."""
    text = PAGE.read_text()
    section = text[text.index("## Engine parameters") :]
    table = section[: section.index("\n\n", section.index("| parameter"))]
    rows = {}
    for line in table.splitlines()[2:]:
        names, default = line.split("|")[1:3]
        for name in re.findall(r"`(\w+)`", names):
            rows[name] = default.strip()
    return rows


def test_every_engine_field_is_in_the_table_once_with_its_default():
    rows = table_rows()
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    assert set(rows) == set(defaults), "docs/configuration.md's parameters differ from EngineConfig"
    for name, default in defaults.items():
        written = rows[name].strip("`")
        if default in WORDS:
            assert written.startswith(WORDS[default]), (name, written)
        elif isinstance(default, bool):
            assert written == str(default).lower(), (name, written)
        else:
            assert written.split()[0] == str(default), (name, written)
