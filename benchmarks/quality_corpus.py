"""The fixed English corpus of `benchmarks.quality`: the prose of Django's documentation.

Source: the Django 5.2.8 source distribution on PyPI (`pip download django==5.2.8 --no-deps
--no-binary :all:`), BSD-3-Clause (its LICENSE is kept beside the corpus). From the reST files
under docs/faq, docs/misc, docs/internals and docs/topics (sorted by path) the prose paragraphs
are kept: code blocks (indented), directives (`..`), headings and tables are dropped, inline
markup is reduced to its text. The result is committed (benchmarks/data/django_docs.txt), so a
run needs no network. The calibration text of GPTQ (backend/tools/gptq_calibration.py) comes from
the other documentation directories of the same release (docs/howto, docs/intro, docs/ref): the same
kind of prose, no paragraph of the corpus (benchmarks/data/django_calibration.txt). This module
rebuilds both:

    python -m benchmarks.quality_corpus /path/to/django-5.2.8.tar.gz
"""

from __future__ import annotations

import hashlib
import re
import sys
import tarfile
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
CORPUS = DATA / "django_docs.txt"
LICENSE = DATA / "django_LICENSE.txt"
SOURCE = {
    "package": "django",
    "version": "5.2.8",
    "registry": "PyPI (source distribution)",
    "files": "docs/{faq,misc,internals,topics}/**/*.txt, prose paragraphs only",
    "license": "BSD-3-Clause (benchmarks/data/django_LICENSE.txt)",
}
DIRECTORIES = ("docs/faq/", "docs/misc/", "docs/internals/", "docs/topics/")
MAX_CHARS = 240_000  # a little over 50k tokens of the default tokenizer
CALIBRATION = DATA / "django_calibration.txt"
CALIBRATION_DIRECTORIES = ("docs/howto/", "docs/intro/", "docs/ref/")
CALIBRATION_CHARS = 160_000  # about 34k tokens

_ROLE = re.compile(r":[\w:.-]+:`~?([^`<]*?)\s*(?:<[^>]*>)?`")  # :doc:`text <target>` -> text
_LITERAL = re.compile(r"``([^`]*)``")
_LINK = re.compile(r"`([^`<]*?)\s*(?:<[^>]*>)?`_+")
_RULE = re.compile(r"^([=\-~^\"'*+#])\1{2,}$")


def prose(text: str) -> list[str]:
    """The prose paragraphs of a reST file, one line each."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip("\n").splitlines()
        if not lines or lines[0][:1].isspace() or lines[0].startswith(".."):
            continue
        if any(_RULE.match(line.strip()) for line in lines) or lines[0].startswith(("|", "+")):
            continue  # headings, tables
        if lines[0].lstrip().startswith(("* ", "- ", "#. ")) and len(lines) == 1:
            continue
        paragraph = " ".join(line.strip() for line in lines)
        paragraph = _LINK.sub(r"\1", _LITERAL.sub(r"\1", _ROLE.sub(r"\1", paragraph)))
        if paragraph.endswith("::"):
            paragraph = paragraph[:-1]
        if len(paragraph.split()) >= 8:
            paragraphs.append(paragraph)
    return paragraphs


def build(
    sdist: str,
    directories: tuple[str, ...] = DIRECTORIES,
    max_chars: int = MAX_CHARS,
    exclude: frozenset[str] = frozenset(),
) -> str:
    """The prose of `directories`, up to `max_chars`, without the paragraphs in `exclude`."""
    paragraphs = []
    with tarfile.open(sdist) as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile()),
            key=lambda m: m.name,
        )
        for member in members:
            path = member.name.split("/", 1)[1]
            if path == "LICENSE":
                LICENSE.write_bytes(tar.extractfile(member).read())
            if path.startswith(directories) and path.endswith(".txt"):
                text = tar.extractfile(member).read().decode("utf-8")
                paragraphs += [p for p in prose(text) if p not in exclude]
    text, size = [], 0
    for paragraph in paragraphs:
        if size >= max_chars:
            break
        text.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(text) + "\n"


def sha256() -> str:
    return hashlib.sha256(CORPUS.read_bytes()).hexdigest()


if __name__ == "__main__":
    DATA.mkdir(exist_ok=True)
    CORPUS.write_text(build(sys.argv[1]))
    print(f"wrote {CORPUS} ({CORPUS.stat().st_size} bytes, sha256 {sha256()})")
    corpus = frozenset(CORPUS.read_text().split("\n\n"))
    calibration = build(sys.argv[1], CALIBRATION_DIRECTORIES, CALIBRATION_CHARS, corpus)
    CALIBRATION.write_text(calibration)
    print(f"wrote {CALIBRATION} ({CALIBRATION.stat().st_size} bytes)")
