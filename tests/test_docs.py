"""The README and docs/*.md say only what is there: every relative link resolves to a file (and its
anchor to a heading), every `python -m X` module their shell commands name imports, every
`make T` target exists, and the flags given to `python -m ensemble build|serve` and
`python -m backend.generate` are theirs. No server, no model: read from the files and parsers."""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "shell", "console")

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE = re.compile(r"`([^`\n]+)`")
MODULE = re.compile(r"\bpython3?\s+-m\s+([A-Za-z_][\w.]*)")
MAKE = re.compile(r"(?:^|[;&|(]\s*)make\s+([A-Za-z][\w-]*)", re.M)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def without_code(text: str) -> str:
    """The text outside fenced blocks and inline code (links there are not links)."""
    return INLINE.sub("", FENCE.sub("", text))


def shell_blocks(text: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in SHELL]


def commands(block: str) -> list[str]:
    """A shell block's command lines: continuations joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            base = slug(heading.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(without_code(page.read_text())) if "://" not in t]


def test_the_docs_are_there():
    assert len(PAGES) > 5, [rel(p) for p in PAGES]
    for page in PAGES[1:]:  # every page is reachable from the README
        assert f"]({rel(page)}" in (ROOT / "README.md").read_text(), f"README omits {rel(page)}"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no {path}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {rel(file)}")
    assert not broken, f"{rel(page)}: " + "; ".join(broken)


def test_links_are_checked():
    """The checker itself: a missing file and a missing anchor are caught, a heading's slug is
    GitHub's."""
    assert slug("Engine parameters (`tensorrt_llm` config.pbtxt / `EngineConfig`)") == (
        "engine-parameters-tensorrt_llm-configpbtxt--engineconfig"
    )
    assert slug("Coming from TensorRT-LLM's backend") == "coming-from-tensorrt-llms-backend"
    assert "two-commands" in anchors(ROOT / "README.md")
    assert "no-such-heading" not in anchors(ROOT / "README.md")
    assert links(ROOT / "README.md"), "the README links to its pages"


def named(pattern: re.Pattern, everywhere: bool = False) -> dict[str, set[str]]:
    """What `pattern` captures in the pages' shell blocks (and inline code, `everywhere`) ->
    the pages that name it."""
    found: dict[str, set[str]] = {}
    for page in PAGES:
        text = page.read_text()
        lines = [c for block in shell_blocks(text) for c in commands(block)]
        if everywhere:
            lines += INLINE.findall(FENCE.sub("", text))
        for line in lines:
            for name in pattern.findall(line):
                found.setdefault(name, set()).add(rel(page))
    return found


MODULES = named(MODULE, everywhere=True)


def test_modules_are_found():
    assert {"ensemble", "backend.generate", "ensemble.perf_analyzer"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_python_module_named_exists(module):
    # Found, not imported: some need an optional extra (benchmarks.plot: matplotlib, `make
    # benchmark` installs it) that `make setup` leaves out.
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError as exc:
        pytest.fail(f"{sorted(MODULES[module])} name `python -m {module}`: {exc}")
    assert found, f"{sorted(MODULES[module])} name `python -m {module}`, which does not exist"


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M))


def test_every_make_target_named_exists():
    targets = makefile_targets()
    named_targets = named(MAKE, everywhere=True)
    assert {"serve", "test"} <= set(named_targets)
    missing = {t: sorted(pages) for t, pages in named_targets.items() if t not in targets}
    assert not missing, f"no such Makefile target: {missing}"


def parser_options(module: str, sub: str | None) -> set[str]:
    if module == "backend.generate":
        from backend.generate import build_parser

        parser = build_parser()
    else:
        from ensemble.__main__ import make_parser

        parser = make_parser()
        choices = next(a for a in parser._actions if a.choices and sub in a.choices).choices
        parser = choices[sub]
    return {o for action in parser._actions for o in action.option_strings}


COMMAND = re.compile(r"\bpython3?\s+-m\s+(ensemble|backend\.generate)(?=\s|$)(.*)")
END = ("|", ";", "&&", "||", ")")


def test_flags_of_the_main_commands_exist():
    """`python -m ensemble build|serve --flag` and `python -m backend.generate --flag` in shell
    blocks: each flag is one the command's parser knows."""
    unknown, checked = [], 0
    for page in PAGES:
        for block in shell_blocks(page.read_text()):
            for line in commands(block):
                found = COMMAND.search(line)
                if not found:
                    continue
                module, rest = found.groups()
                words = []
                for word in shlex.split(rest):
                    if word in END or word.startswith(">"):
                        break  # the command ends here
                    words.append(word)
                sub = None
                if module == "ensemble":
                    if not words or words[0] not in ("build", "serve", "check"):
                        continue
                    sub, words = words[0], words[1:]
                options = parser_options(module, sub)
                for word in words:
                    if word.startswith("--"):
                        checked += 1
                        if word.split("=")[0] not in options:
                            unknown.append(f"{rel(page)}: {module} {sub or ''} {word}")
    assert checked > 20
    assert not unknown, unknown
