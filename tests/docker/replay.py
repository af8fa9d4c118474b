"""Replay docker/Dockerfile without a Docker engine.

A directory stands for the image's filesystem: COPY copies exactly what it names from the build
context (honouring .dockerignore), ENV and WORKDIR apply, and each RUN step's `python3` commands
run there under this interpreter. `pip install` commands are recorded, not run (this environment
already holds what they install, as CPU builds); their pins are checked by the tests.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = PROJECT_ROOT / "docker" / "Dockerfile"


class ReplayError(AssertionError):
    """A step that would fail in `docker build` (or that this replay cannot reproduce)."""


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


def parse(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined; comment lines dropped (as Docker does)."""
    instructions, pending, start = [], "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        pending = ""
    return instructions


def dockerignore_patterns(context: Path = PROJECT_ROOT) -> list[str]:
    path = context / ".dockerignore"
    if not path.exists():
        return []
    patterns = [
        p.strip().rstrip("/")
        for p in path.read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    if any(p.startswith("!") for p in patterns):
        raise ReplayError(".dockerignore exceptions (!pattern) are not replayed")
    return patterns


def ignored(relative: str, patterns: list[str]) -> bool:
    """Whether a context path (posix, relative) or one of its parents is excluded."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(
        fnmatch.fnmatchcase(prefix, p)
        or (p.startswith("**/") and fnmatch.fnmatchcase(prefix.split("/")[-1], p[3:]))
        for prefix in prefixes
        for p in patterns
    )


@dataclass
class Image:
    root: Path  # stands for the image's "/"
    context: Path = PROJECT_ROOT
    base: str = ""
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    pip_installs: list[list[str]] = field(default_factory=list)  # arguments after `pip install`
    ran: list[list[str]] = field(default_factory=list)  # python3 commands, as written
    cmd: list[str] = field(default_factory=list)
    execute: bool = True  # False: only record (for the pin checks)

    def path(self, image_path: str) -> Path:
        """An image path (absolute, or relative to WORKDIR) -> the replay's copy of it."""
        posix = PurePosixPath(self.workdir) / image_path
        return self.root / str(posix).lstrip("/")

    def local(self, text: str) -> str:
        """Image paths under WORKDIR written in a command -> the replay's paths."""
        if self.workdir == "/":
            return text
        return text.replace(self.workdir, str(self.path(self.workdir)))

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only the image's
        env.update({k: self.local(v) for k, v in self.env.items()})
        return env

    def run_python(self, argv: list[str], line: int = 0, timeout: float = 300) -> None:
        """One `python3 ...` command of the image, run here with cwd = WORKDIR."""
        self.ran.append(argv)
        if not self.execute:
            return
        local = [sys.executable] + [self.local(a) for a in argv[1:]]
        result = subprocess.run(
            local,
            cwd=self.path(self.workdir),
            env=self.environment(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise ReplayError(
                f"Dockerfile line {line}: {shlex.join(argv)} failed "
                f"(exit {result.returncode}):\n{result.stderr[-3000:]}"
            )

    def run_shell(self, command: str, line: int = 0) -> None:
        """A RUN step: `&&`-chained commands; python3 ones run, pip installs are recorded."""
        for part in re.split(r"\s*&&\s*", command.strip()):
            argv = shlex.split(part)
            if argv[:1] != ["python3"]:
                raise ReplayError(
                    f"Dockerfile line {line}: only python3 commands are replayed: {part}"
                )
            if argv[1:4] == ["-m", "pip", "install"]:
                self.pip_installs.append(argv[4:])
            else:
                self.run_python(argv, line)

    def copy(self, args: str, line: int) -> None:
        words = shlex.split(args)
        if any(w.startswith("--") for w in words):
            raise ReplayError(f"Dockerfile line {line}: COPY flags are not replayed: {args}")
        *sources, dest = words
        if not self.execute:
            return
        target = self.path(dest)
        patterns = dockerignore_patterns(self.context)
        for source in sources:
            src = self.context / source
            if not src.exists() or ignored(source.rstrip("/"), patterns):
                raise ReplayError(
                    f"Dockerfile line {line}: COPY {source}: not in the build context"
                )
            if src.is_dir():  # Docker copies a directory's contents into the destination
                shutil.copytree(src, target, dirs_exist_ok=True, ignore=self._ignore(patterns))
            else:
                into = dest.endswith("/") or len(sources) > 1
                out = target / src.name if into else target
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, out)

    def _ignore(self, patterns: list[str]):
        def skip(directory: str, names: list[str]) -> list[str]:
            rel = Path(directory).resolve().relative_to(self.context.resolve()).as_posix()
            return [n for n in names if ignored(n if rel == "." else f"{rel}/{n}", patterns)]

        return skip

    def set_env(self, args: str, line: int) -> None:
        if "$" in args:
            raise ReplayError(f"Dockerfile line {line}: variable expansion in ENV is not replayed")
        words = shlex.split(args)
        if "=" not in words[0]:
            key, _, value = args.partition(" ")
            self.env[key] = value.strip()
            return
        for word in words:
            key, _, value = word.partition("=")
            self.env[key] = value


def replay(
    root: Path, dockerfile: Path = DOCKERFILE, context: Path = PROJECT_ROOT, execute: bool = True
) -> Image:
    """Build the image's filesystem under `root` as `docker build` would (see the module doc)."""
    image = Image(root=root, context=context, execute=execute)
    args: dict[str, str] = {}
    for step in parse(dockerfile.read_text()):
        if step.keyword == "ARG":
            name, _, default = step.args.partition("=")
            args[name] = default
        elif step.keyword == "FROM":
            image.base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), step.args)
        elif step.keyword == "WORKDIR":
            image.workdir = str(PurePosixPath(image.workdir) / step.args)
            if execute:
                image.path(image.workdir).mkdir(parents=True, exist_ok=True)
        elif step.keyword == "ENV":
            image.set_env(step.args, step.line)
        elif step.keyword == "COPY":
            image.copy(step.args, step.line)
        elif step.keyword == "RUN":
            image.run_shell(step.args, step.line)
        elif step.keyword == "CMD":
            image.cmd = json.loads(step.args)
        elif step.keyword not in ("EXPOSE", "LABEL"):
            raise ReplayError(f"Dockerfile line {step.line}: {step.keyword} is not replayed")
    return image
